"""Rollout dump and replay (``rollout_dump``, ROLL's ``rollout_mock``): the files round-trip bit for
bit, every bad input is one line naming the file or key, ROLL's key maps, and a CPU pipeline
replaying a dump trains on the same batches and logs the same metrics as the run that dumped it."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_async_rollouts import FakeSampler  # noqa: E402
from test_pipeline_e2e import comparable, config_dict, load, pipeline_dir  # noqa: E402
from test_roll_examples import EXAMPLES, roll_workdir  # noqa: E402, F401 (a fixture)

from roll.configs.errors import ConfigError  # noqa: E402
from roll.configs.loader import load_config  # noqa: E402
from roll.configs.roll_compat import translate_roll_keys  # noqa: E402
from roll.core.batch import Batch  # noqa: E402
from roll.core.errors import RolloutDumpError  # noqa: E402
from roll.launch.rlvr import main  # noqa: E402
from roll.pipeline.common.timing import StageTimer  # noqa: E402
from roll.pipeline.rlvr import rollout_source, stages  # noqa: E402
from roll.pipeline.rlvr.rollout_dump import MANIFEST, RolloutDump, check_dump_dir  # noqa: E402
from roll.utils.tracking import read_metrics  # noqa: E402

EXAMPLE = Path(__file__).parents[1] / "examples" / "config" / "rlvr_config.yaml"


class FakeTokenizer:
    def __init__(self, extra: int = 0) -> None:
        self.vocab = {f"t{i}": i for i in range(10 + extra)}

    def get_vocab(self) -> dict[str, int]:
        return dict(self.vocab)


def cfg(root: Path, mode: str, *overrides: str):
    return load_config(EXAMPLE, [f"rollout_dump.mode={mode}", f"rollout_dump.dir={root}", *overrides])


def sample_batch(step: int) -> tuple[Batch, dict[str, float]]:
    g = torch.Generator().manual_seed(step)
    tensors = {
        "responses": torch.randint(0, 100, (4, 6), generator=g),
        "response_mask": torch.ones(4, 6, dtype=torch.bool),
        "infer_logprobs": torch.randn(4, 6, generator=g),
        "half": torch.randn(4, 2, generator=g).to(torch.bfloat16),
        "scores": torch.tensor([0.0, 1.0, float("nan"), -0.5]),
    }
    non_tensors = {
        "group_id": [f"{step}-0", f"{step}-0", f"{step}-1", f"{step}-1"],
        "ground_truth": [{"answer": "3", "tests": [1, 2]}, "4", None, "é"],
        "tag": np.array(["a", "b", "a", "b"]),  # a fixed-width str array, not object
    }
    batch = Batch.from_dict(tensors, non_tensors, {"temperature": 0.7})
    return batch, {"rollout/staleness": 0.0, "dynamic_sampling/rounds": 2.0}


def dump_steps(root: Path, steps: int, tokenizer=None) -> None:
    dump = RolloutDump.open(cfg(root, "dump"), tokenizer or FakeTokenizer())
    for step in range(1, steps + 1):
        dump.write(step, *sample_batch(step))


def assert_same_batch(a: Batch, b: Batch) -> None:
    assert a.tensors.keys() == b.tensors.keys() and a.non_tensors.keys() == b.non_tensors.keys()
    for key, value in a.tensors.items():
        assert value.dtype == b.tensors[key].dtype, key
        # bit for bit, NaN included
        assert torch.equal(value.view(-1).view(torch.uint8), b.tensors[key].view(-1).view(torch.uint8)), key
    for key, value in a.non_tensors.items():
        assert value.dtype == b.non_tensors[key].dtype and value.tolist() == b.non_tensors[key].tolist(), key
    assert a.meta == b.meta


def test_dump_and_read_back_bit_for_bit(tmp_path):
    root = tmp_path / "dump"
    dump_steps(root, 2)
    assert sorted(p.name for p in root.iterdir()) == [
        MANIFEST, "step_1.json", "step_1.safetensors", "step_2.json", "step_2.safetensors",
    ]  # fmt: skip
    manifest = json.loads((root / MANIFEST).read_text())
    assert manifest["values"]["response_length"] == 32 and manifest["values"]["tokenizer.vocab_size"] == 10
    assert manifest["roll_version"] and set(manifest["steps"]) == {"1", "2"}
    replay = RolloutDump.open(cfg(root, "replay", "max_steps=2"), FakeTokenizer())
    for step in (1, 2):
        batch, metrics = replay.read(step)
        expected, expected_metrics = sample_batch(step)
        assert_same_batch(batch, expected)
        assert metrics == expected_metrics


def test_replay_dir_missing(tmp_path):
    with pytest.raises(ConfigError, match=r"rollout_dump.dir: .*/nope: no such directory"):
        check_dump_dir(cfg(tmp_path / "nope", "replay"))


def test_replay_dir_without_manifest(tmp_path):
    (tmp_path / "d").mkdir()
    with pytest.raises(ConfigError, match=r"rollout_dump.dir: .*/d/manifest.json: no such file"):
        check_dump_dir(cfg(tmp_path / "d", "replay"))


def test_replay_manifest_not_json(tmp_path):
    dump_steps(tmp_path / "d", 1)
    (tmp_path / "d" / MANIFEST).write_text('{"format": 1, "val')
    with pytest.raises(ConfigError, match=r"manifest.json: not JSON"):
        check_dump_dir(cfg(tmp_path / "d", "replay", "max_steps=1"))


def test_replay_past_the_dumped_steps_stops_at_launch(tmp_path):
    dump_steps(tmp_path / "d", 2)
    with pytest.raises(ConfigError) as exc:
        check_dump_dir(cfg(tmp_path / "d", "replay", "max_steps=3"))
    assert str(exc.value).startswith("max_steps: 3, but ") and "holds steps 1-2" in str(exc.value)
    assert "at most 2" in str(exc.value) and "\n" not in str(exc.value)


def test_replay_step_file_missing(tmp_path):
    dump_steps(tmp_path / "d", 2)
    (tmp_path / "d" / "step_2.json").unlink()
    with pytest.raises(
        ConfigError, match=r"rollout_dump.dir: .*/d/step_2.json: no such file \(listed in manifest"
    ):
        check_dump_dir(cfg(tmp_path / "d", "replay", "max_steps=2"))


@pytest.mark.parametrize(
    ("override", "key", "dumped", "now"),
    [
        ("response_length=24", "response_length", "32", "24"),
        ("rollout_batch_size=8", "rollout_batch_size", "16", "8"),
        (
            "pretrain=other/model",
            "actor_train.model_args.model_name_or_path",
            "'./output/default_example/sft_model'",
            "'other/model'",
        ),
    ],
)
def test_replay_value_differs_from_the_dump(tmp_path, override, key, dumped, now):
    dump_steps(tmp_path / "d", 1)
    with pytest.raises(ConfigError) as exc:
        check_dump_dir(cfg(tmp_path / "d", "replay", "max_steps=1", override))
    line = str(exc.value)
    assert line.startswith("rollout_dump.dir: ") and f"{key} differs: dumped with {dumped}" in line
    assert f"this run has {now}" in line and "\n" not in line


def test_replay_tokenizer_differs(tmp_path):
    dump_steps(tmp_path / "d", 1)
    with pytest.raises(ConfigError, match=r"tokenizer.vocab_size differs: dumped with 10, this run has 11"):
        RolloutDump.open(cfg(tmp_path / "d", "replay", "max_steps=1"), FakeTokenizer(extra=1))


def test_replay_corrupted_file(tmp_path):
    dump_steps(tmp_path / "d", 2)
    path = tmp_path / "d" / "step_2.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    replay = RolloutDump.open(cfg(tmp_path / "d", "replay", "max_steps=2"), FakeTokenizer())
    replay.read(1)  # the good step still reads
    with pytest.raises(RolloutDumpError, match=r"/d/step_2.safetensors: sha256 differs from manifest.json"):
        replay.read(2)


def test_replay_step_file_removed_after_launch(tmp_path):
    dump_steps(tmp_path / "d", 1)
    replay = RolloutDump.open(cfg(tmp_path / "d", "replay", "max_steps=1"), FakeTokenizer())
    (tmp_path / "d" / "step_1.safetensors").unlink()
    with pytest.raises(
        RolloutDumpError, match=r"/d/step_1.safetensors: No such file or directory \(listed in"
    ):
        replay.read(1)


def test_dump_over_an_existing_dump_is_refused_unless_resuming(tmp_path):
    dump_steps(tmp_path / "d", 2)
    before = {p.name: p.read_bytes() for p in (tmp_path / "d").iterdir()}
    with pytest.raises(ConfigError) as exc:
        check_dump_dir(cfg(tmp_path / "d", "dump"))
    line = str(exc.value)
    assert line.startswith("rollout_dump.dir: ") and "already holds files (manifest.json, step_1.json" in line
    assert "resume_from_checkpoint" in line
    assert {p.name: p.read_bytes() for p in (tmp_path / "d").iterdir()} == before  # nothing lost
    # A resumed run continues the dump (after checking it was made with the same values).
    assert check_dump_dir(cfg(tmp_path / "d", "dump", "resume_from_checkpoint=true"))["steps"].keys() == {
        "1",
        "2",
    }
    with pytest.raises(ConfigError, match="response_length differs"):
        check_dump_dir(cfg(tmp_path / "d", "dump", "resume_from_checkpoint=true", "response_length=8"))


def test_dump_into_a_file_or_without_dir(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match=r"rollout_dump.dir: .*/f is a file, not a directory"):
        check_dump_dir(cfg(tmp_path / "f", "dump"))
    with pytest.raises(ConfigError, match=r"rollout_dump.dir: is required with mode 'dump'"):
        load_config(EXAMPLE, ["rollout_dump.mode=dump"])
    with pytest.raises(ConfigError, match=r"rollout_dump.mode: expected one of \['none', 'dump', 'replay'\]"):
        load_config(EXAMPLE, ["rollout_dump.mode=mock", "rollout_dump.dir=x"])


def test_a_field_json_cannot_keep_is_named(tmp_path):
    dump = RolloutDump.open(cfg(tmp_path / "d", "dump"), FakeTokenizer())
    batch = Batch.from_dict({"x": torch.zeros(2)}, {"odd": [(1, 2), (3, 4)]})
    with pytest.raises(RolloutDumpError, match="field 'odd' holds a tuple"):
        dump.write(1, batch, {})


@pytest.mark.parametrize(
    ("mock", "expected"),
    [
        ({"enable": True, "mode": "dump", "dump_dir": "d"}, {"mode": "dump", "dir": "d"}),
        ({"enable": True, "mode": "mock", "dump_dir": "d"}, {"mode": "replay", "dir": "d"}),
        ({"enable": False, "mode": "dump", "dump_dir": "d"}, None),
    ],
)
def test_roll_rollout_mock_maps(mock, expected):
    raw = translate_roll_keys({"rollout_mock": mock})
    assert "rollout_mock" not in raw and raw.get("rollout_dump") == expected


@pytest.mark.parametrize(
    ("mock", "words"),
    [
        (
            {"enable": True, "mode": "record", "dump_dir": "d"},
            "rollout_mock.mode='record' (ROLL's modes are dump and mock)",
        ),
        ({"enable": True, "mode": "dump"}, "rollout_mock.dump_dir (is required"),
        (
            {"enable": True, "mode": "dump", "dump_dir": "d", "format": "pkl"},
            "rollout_mock.format (not a ROLL",
        ),
    ],
)
def test_roll_rollout_mock_refused(mock, words):
    with pytest.raises(ConfigError) as exc:
        translate_roll_keys({"rollout_mock": mock})
    assert words in str(exc.value)


def test_a_resumed_dump_continues_the_manifest(tmp_path):
    dump_steps(tmp_path / "d", 2)
    dump = RolloutDump.open(cfg(tmp_path / "d", "dump", "resume_from_checkpoint=true"), FakeTokenizer())
    dump.write(2, *sample_batch(7))  # the step after the checkpoint, written again
    dump.write(3, *sample_batch(3))
    replay = RolloutDump.open(cfg(tmp_path / "d", "replay", "max_steps=3"), FakeTokenizer())
    assert_same_batch(replay.read(1)[0], sample_batch(1)[0])
    assert_same_batch(replay.read(2)[0], sample_batch(7)[0])
    assert_same_batch(replay.read(3)[0], sample_batch(3)[0])


def test_replay_one_step_ahead_reads_each_step_once(tmp_path):
    dump_steps(tmp_path / "d", 3)
    config = cfg(tmp_path / "d", "replay", "max_steps=3", "async_generation_ratio=1")
    run = SimpleNamespace(config=config, tokenizer=FakeTokenizer(), sampler=FakeSampler(), weight_version=0)
    source = rollout_source.RolloutSource(run)
    try:
        for step in (1, 2, 3):
            timer = StageTimer()
            batch, metrics = source.take(step, timer)
            assert_same_batch(batch, sample_batch(step)[0])
            assert metrics == sample_batch(step)[1]
            source.settle()
    finally:
        source.close()


def test_launch_refuses_a_roll_dump_over_an_old_one_and_a_replay_without_dump(request, monkeypatch, capsys):
    workdir = request.getfixturevalue("roll_workdir")  # test_roll_examples' model dirs and data
    monkeypatch.chdir(workdir)
    name = "qwen2.5-7B-rlvr_megatron__rlvr_rollout_mock_dump.yaml"
    old = workdir / "old_dump"
    old.mkdir()
    (old / "step_1.json").write_text("{}")
    for overrides, words in (
        (
            [f"rollout_mock.dump_dir={old}"],
            f"ConfigError: rollout_dump.dir: {old} already holds files (step_1.json)",
        ),
        (
            ["rollout_mock.mode=mock", "rollout_mock.dump_dir=none_here"],
            "ConfigError: rollout_dump.dir: none_here: no such",
        ),
    ):
        code = main(["--config_path", str(EXAMPLES), "--config_name", name, "--dry_run", *overrides])
        errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("ConfigError")]
        assert code == 2 and len(errors) == 1 and errors[0].startswith(words), errors
    assert (old / "step_1.json").read_text() == "{}"


# --- the pipeline on CPU: dump, then replay ----------------------------------------------------


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    yield from pipeline_dir(tmp_path_factory, "dump")


def record_batches(monkeypatch) -> list[tuple[Batch, dict]]:
    """Copies of the batches RolloutSource hands the step loop (before the stages add fields)."""
    seen: list[tuple[Batch, dict]] = []
    collect = rollout_source.RolloutSource.collect

    def recording(self, step, timer):
        batch, metrics = collect(self, step, timer)
        copy = Batch(
            {k: v.clone() for k, v in batch.tensors.items()}, dict(batch.non_tensors), dict(batch.meta)
        )
        seen.append((copy, dict(metrics)))
        return batch, metrics

    monkeypatch.setattr(rollout_source.RolloutSource, "collect", recording)
    return seen


@pytest.mark.slow
def test_replayed_run_trains_on_the_dumped_rollouts(setup, monkeypatch):
    from roll.pipeline.rlvr.pipeline import run_pipeline

    tmp, model = setup
    dump_dir = tmp / "rollouts"
    common = {"max_steps": 2, "save_steps": 0, "eval_steps": 0}
    dumped = record_batches(monkeypatch)
    cfg_dump = config_dict(
        tmp, model, tmp / "dump", rollout_dump={"mode": "dump", "dir": str(dump_dir)}, **common
    )
    first = read_metrics(run_pipeline(load(tmp, "dump", cfg_dump)) / "metrics.jsonl")
    assert len(dumped) == 2 and (dump_dir / "step_2.safetensors").is_file()

    monkeypatch.undo()
    replayed = record_batches(monkeypatch)

    def refuse(*args, **kwargs):
        raise AssertionError("replay generated or scored rollouts")

    monkeypatch.setattr(stages, "generate_rollouts", refuse)
    monkeypatch.setattr(stages, "compute_rewards", refuse)
    cfg_replay = config_dict(
        tmp, model, tmp / "replay", rollout_dump={"mode": "replay", "dir": str(dump_dir)}, **common
    )
    second = read_metrics(run_pipeline(load(tmp, "replay", cfg_replay)) / "metrics.jsonl")

    assert len(replayed) == 2
    for (a, metrics_a), (b, metrics_b) in zip(dumped, replayed):
        assert_same_batch(a, b)
        assert metrics_a == metrics_b
    assert [r["step"] for r in first] == [r["step"] for r in second] == [1, 2]
    for row_a, row_b in zip(first, second):
        assert "actor/pg_loss" in row_a and "critic/score/mean" in row_a
        assert comparable(row_a) == comparable(row_b)
    assert "time/replay" in second[0] and "time/generate" not in second[0]
