"""The CPU-checkable parts of ``benchmarks/model_update_engine.py``: its arguments, the one line it
fails with where it cannot run, which engine receives each layout's buckets (as the pipeline picks
it), and the table (same columns for vLLM and SGLang, bound = bytes / bandwidth)."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import types
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import model_update_engine as bench  # noqa: E402


def test_arguments_and_their_errors(capsys):
    args = bench.parse_args(["--engine", "sglang", "--presets", "qwen2.5-1.5b,qwen2.5-7b"])
    assert args.engine == "sglang" and args.reps == 3 and args.bucket_mb == 1024
    for argv, says in [
        (["--engine", "sglng"], "invalid choice: 'sglng'"),
        (["--presets", "qwen2.5-1.5b,qwen9"], "--presets: unknown ['qwen9']"),
        (["--reps", "0"], "--reps and --bucket_mb must be >= 1"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            bench.parse_args(argv)
        assert exit_.value.code == 2 and says in capsys.readouterr().err


def test_without_two_gpus_it_is_one_line_and_exit_2():
    proc = subprocess.run(
        [sys.executable, "benchmarks/model_update_engine.py", "--engine", "sglang"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "model_update_engine: needs 2 GPUs (trainer and colocated engine on GPU 0, disaggregated engine "
        "on GPU 1); 0 visible"
    ]


def fake_sglang(monkeypatch, version: str) -> None:
    monkeypatch.setitem(sys.modules, "sglang", types.ModuleType("sglang"))
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda n: version if n == "sglang" else real(n))


def test_engine_missing_or_of_an_untested_version_is_named_before_any_process(monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", None)
    assert "pip install -e .[sglang]" in bench.cannot_run("sglang", 2)
    fake_sglang(monkeypatch, "0.4.9")
    assert "runs on sglang >=0.5.16,<0.6 but 0.4.9 is installed" in bench.cannot_run("sglang", 2)
    fake_sglang(monkeypatch, "0.5.16")
    assert bench.cannot_run("sglang", 2) is None
    assert bench.cannot_run("sglang", 1).startswith("needs 2 GPUs")


# (the engine takes the buckets itself, the engine joins the broadcast group) per layout. SGLang's
# disagg-tensor buckets land in the worker's buffer: its engine must not be asked to join a group
# (the first version of this benchmark asked it); on disagg its schedulers build their own group.
@pytest.mark.parametrize(
    "engine, want",
    [
        ("sglang", {"colocated": (True, False), "disagg": (True, True), "disagg-tensor": (False, False)}),
        ("vllm", {"colocated": (True, False), "disagg": (True, True)}),
    ],
)
def test_each_layout_reaches_the_engine_as_the_pipeline_sends_it(engine, want):
    from roll.configs.strategy_configs import SGLangConfig, VLLMConfig
    from roll.distributed.strategy.registry import check_strategy_class

    strategy = object.__new__(check_strategy_class(engine))  # the class, without its engine
    strategy.config = SGLangConfig() if engine == "sglang" else VLLMConfig()
    got = {}
    for layout, owner in bench.layouts(engine).items():
        receiver, join = bench.receiving_engine(strategy, bench.link_spec(layout, 1, engine), owner)
        got[layout] = (receiver is strategy, join is not None)
    assert got == want
    assert bench.link_spec("disagg", 1, engine).engine_group == (engine == "sglang")


def test_table_has_the_same_columns_for_every_engine_and_the_nccl_bound():
    data = {
        "bw": 100.0,
        "rows": [
            {"preset": "qwen2.5-7b", "layout": "colocated", "bytes": 15.2e9, "sync_s": 0.1},
            {"preset": "qwen2.5-7b", "layout": "disagg", "bytes": 15.2e9, "sync_s": 0.304},
            {"preset": "qwen2.5-7b", "layout": "disagg-tensor", "bytes": 15.2e9, "sync_s": 0.608},
        ],
    }
    tables = {e: bench.table_lines(data, e, "1.0") for e in ("vllm", "sglang")}
    assert tables["vllm"][2] == tables["sglang"][2]
    assert tables["sglang"][2].split() == ["preset", "layout", "GB", "sync", "ms", "bound", "ms", "ratio"]
    assert "update_weights_from_tensor" in tables["sglang"][1]
    assert "update_weights_from_distributed" in tables["sglang"][1]
    assert tables["sglang"][5].split() == ["qwen2.5-7b", "disagg-tensor", "15.20", "608.0", "152.0", "4.00"]
    assert tables["sglang"][4].split() == ["qwen2.5-7b", "disagg", "15.20", "304.0", "152.0", "2.00"]
    assert tables["sglang"][0].startswith("model update into sglang 1.0 (roll sglang strategy)")


def test_a_failing_member_prints_its_own_error_under_its_name(monkeypatch, capsys):
    def broken(rank, *args):
        raise RuntimeError("engine start failed: no module named sglang.srt")

    monkeypatch.setattr(bench, "_member", broken)
    with pytest.raises(RuntimeError):
        bench.member(bench.DISAGG, None, {}, {}, "")
    err = capsys.readouterr().err
    assert "the disaggregated engine (process 2) failed" in err and "no module named sglang.srt" in err


def test_config_dir_names_the_model_class(tmp_path):
    """SGLang reads the model class from config.json's ``architectures`` (its engine stopped on
    ``hf_config.architectures[0]`` of None at start-up); the directory records it as a checkpoint would."""
    import json

    from roll.models.tiny import build_tokenizer

    build_tokenizer(["1 + 2 = 3"] * 20).save_pretrained(tmp_path / "tok")
    out = bench.write_config_dir("qwen2.5-1.5b", tmp_path, str(tmp_path / "tok"))
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
