"""The GPU speed guard's reading, comparing and baseline logic (benchmarks/gpu_speed.py), on CPU."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from roll.planner.model_shape import ModelShape

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import gpu_speed  # noqa: E402

RUN = gpu_speed.SpeedRun("qwen2.5-1.5B-rlvr_megatron_vllm_2gpus", 2)
ROWS = [
    {
        "step": 1,
        "startup/workers_s": 5.0,
        "startup/initialize_s": 30.0,
        "startup/to_first_step_s": 50.0,
        "time/generate": 9.0,
        "time/train": 20.0,
        "time/step": 29.0,
        "memory/peak_used_gib_max": 40.0,
    },
    {
        "step": 2,
        "time/generate": 4.0,
        "time/train": 6.0,
        "time/validation": 3.0,
        "swap/actor_infer/reload_s": 0.25,
        "time/step": 10.0,
        "perf/tokens": 1000.0,
        "perf/response_tokens": 800.0,
        "memory/peak_used_gib_max": 42.5,
    },
]


def test_the_last_step_and_the_first_rows_start_up_are_read() -> None:
    m = gpu_speed.measured_from_rows(RUN, ROWS, 0, 120.0)
    assert m.startup == {"workers": 5.0, "initialize": 30.0} and m.startup_s == 50.0
    assert m.stages == {"generate": 4.0, "train": 6.0} and m.step_s == 10.0  # validation left out
    assert m.peak_gib == 42.5 and m.tokens == 1000.0
    assert m.swaps == {"actor_infer/reload": 0.25}


def test_a_stage_slower_than_tolerance_and_floor_is_named() -> None:
    m = gpu_speed.measured_from_rows(RUN, ROWS, 0, 120.0)
    base = {"startup_s": 49.0, "step_s": 9.5, "stages": {"generate": 4.05, "train": 5.0}}
    lines = gpu_speed.regressions(m, base, tolerance=0.15, floor_s=0.1)
    assert lines == [f"{RUN.config}: train 6.00 s vs baseline 5.00 s (+20%)"]
    assert gpu_speed.regressions(m, None, 0.15, 0.1) == []
    tiny = {"stages": {"generate": 3.0}}  # +33% but under the floor is not a regression
    m.stages = {"generate": 3.05}
    assert gpu_speed.regressions(m, tiny, 0.01, 0.1) == []


def test_the_baseline_file_round_trips_and_keeps_other_runs(tmp_path: Path) -> None:
    path = tmp_path / "nvidia-h200.json"
    path.write_text(json.dumps({"gpu": "NVIDIA H200", "runs": {"other": {"step_s": 1.0}}}))
    m = gpu_speed.measured_from_rows(RUN, ROWS, 0, 120.0)
    m.predicted_peak_gib = 41.0
    failed = gpu_speed.Measured("broken", 1, 1, 5.0)
    data = gpu_speed.save_baseline(path, "NVIDIA H200", "abc1234", [m, failed])
    saved = json.loads(path.read_text())
    assert saved == data and set(saved["runs"]) == {"other", RUN.config}
    run = saved["runs"][RUN.config]
    assert run["stages"] == {"generate": 4.0, "train": 6.0} and run["predicted_peak_gib"] == 41.0
    assert run["gpus"] == 2 and saved["commit"] == "abc1234"
    assert run["host"] == {}  # a run measured without the probe (--from_runs) keeps no host figures


def test_predicted_peak_is_the_largest_device_peak_of_the_plan() -> None:
    text = (
        "devices ...\n          device peak 37.2 of 139.8 GiB, while actor_train runs\n"
        "          device peak 12.0 of 139.8 GiB, while reference runs\n"
    )
    assert gpu_speed.predicted_peak(text) == 37.2
    assert gpu_speed.predicted_peak("no memory plan: device: cpu") is None


def test_bounds_follow_flops_and_bandwidth() -> None:
    dense = ModelShape(
        model_type="qwen2",
        hidden=1536,
        layers=28,
        heads=12,
        kv_heads=2,
        head_dim=128,
        ffn=8960,
        vocab=151936,
        tied=True,
    )
    n = dense.total_params()
    b = gpu_speed.stage_bounds(dense, tokens=1e5, gpus=2, response_length=512, flops=1e15, hbm=5e12)
    assert b["train"] == pytest.approx(6 * n * 1e5 / 2e15)
    assert b["reference"] == pytest.approx(2 * n * 1e5 / 2e15)
    assert b["generate"] == pytest.approx(max(2 * n * 1e5 / 2e15, 512 * 2 * n / 5e12))
    moe = ModelShape(
        model_type="qwen3_moe",
        hidden=64,
        layers=2,
        heads=4,
        kv_heads=2,
        head_dim=16,
        ffn=128,
        vocab=100,
        tied=False,
        experts=8,
        top_k=2,
        moe_ffn=32,
        moe_layers=2,
    )
    assert gpu_speed.active_params(moe) == moe.total_params() - moe.expert_params() * 6 // 8


def test_gpu_names_and_tables() -> None:
    assert gpu_speed.gpu_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100"
    assert gpu_speed.datasheet("NVIDIA H200")[:2] == (989e12, 4.8e12)
    m = gpu_speed.measured_from_rows(RUN, ROWS, 0, 120.0)
    table = "\n".join(gpu_speed.run_table(m, {"stages": {"train": 5.0}}, {"train": 0.5}))
    assert "| train | 6.00 | 5.00 | 1.20x | 0.500 |" in table
    assert "**start-up to first step** | 50.00" in table
    assert "| (within the stages) actor_infer/reload | 0.25 |" in table


def test_the_host_figures_sit_beside_the_baseline_hosts_as_a_slowdown() -> None:
    """A slower host shows as slowdowns > 1 in every figure, whichever way the figure runs."""
    m = gpu_speed.measured_from_rows(RUN, ROWS, 0, 120.0)
    m.host = {"python_loop_ms": 40.0, "cuda_launch_us": 6.0, "matmul_tflops": 500.0, "cpus": 64.0}
    base = {"host": {"python_loop_ms": 20.0, "cuda_launch_us": 4.0, "matmul_tflops": 750.0}}
    table = "\n".join(gpu_speed.run_table(m, base, {}))
    assert "| host: python_loop_ms | 40.0 | 20.0 | 2.00x | |" in table
    assert "| host: cuda_launch_us | 6.00 | 4.00 | 1.50x | |" in table
    assert "| host: matmul_tflops | 500 | 750 | 1.50x | |" in table  # fewer TFLOP/s: slower
    assert "torch_small_op_us" not in table  # measured on neither host
    assert gpu_speed.Measured("x", 1, 0, 1.0, host=m.host).as_baseline()["host"] == m.host


def test_the_host_probe_measures_the_cpu_figures_here_in_a_process_of_its_own() -> None:
    import torch

    figures = gpu_speed.probe_host_apart()  # its CUDA context, if any, leaves with it
    assert figures["python_loop_ms"] > 0 and figures["torch_small_op_us"] > 0 and figures["cpus"] >= 1
    assert ("cuda_launch_us" in figures) == torch.cuda.is_available()


def test_run_devices_are_indices_among_the_visible_gpus(monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert gpu_speed._env(Path("/repo"), "1")["CUDA_VISIBLE_DEVICES"] == "3"
    assert gpu_speed._env(Path("/repo"), "0,1")["CUDA_VISIBLE_DEVICES"] == "2,3"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert gpu_speed._env(Path("/repo"), "0,1")["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert gpu_speed._env(Path("/repo"), "")["CUDA_VISIBLE_DEVICES"] == ""  # the dry run: CUDA hidden


def test_drafts_run_only_when_named_and_launch_from_pending_gpu() -> None:
    repo = Path(__file__).resolve().parents[1]
    for run in gpu_speed.RUNS:  # every run's file is where the guard looks for it
        assert (repo / run.config_dir / f"{run.config}.yaml").exists(), run.config
    drafts = {r.config for r in gpu_speed.RUNS if r.pending}
    assert drafts and all((repo / "examples/config/pending_gpu" / f"{c}.yaml").exists() for c in drafts)
    assert not drafts & {r.config for r in gpu_speed.select_runs(8, set())}  # not in the default set
    named = gpu_speed.select_runs(4, {"qwen3-30B-A3B-rlvr_megatron_vllm_4gpus_disagg"})
    assert [r.config for r in named] == ["qwen3-30B-A3B-rlvr_megatron_vllm_4gpus_disagg"]
    cmd = named[0].launcher("--dry_run")
    assert cmd[-5:] == [
        "--config_path",
        "examples/config/pending_gpu",
        "--config_name",
        "qwen3-30B-A3B-rlvr_megatron_vllm_4gpus_disagg",
        "--dry_run",
    ]
    assert "--config_path" not in RUN.launcher()


def test_a_run_is_stopped_once_its_last_step_is_logged(tmp_path: Path, monkeypatch) -> None:
    """The guard needs the last step's row only: a run still exporting after it is stopped then,
    not left to run into --timeout."""
    import subprocess
    import time

    script = (
        "import json, sys, time\n"
        f"path = {str(tmp_path / RUN.config / 'metrics.jsonl')!r}\n"
        "for step in (1, 2, 3):\n"
        "    open(path, 'a').write(json.dumps({'step': step, 'time/step': 1.0}) + '\\n')\n"
        "time.sleep(120)  # the end-of-run export\n"
    )
    (tmp_path / RUN.config).mkdir()

    def fake_launch(repo, run, steps, out, devices, extra=()):
        return subprocess.Popen([sys.executable, "-c", script]), []

    monkeypatch.setattr(gpu_speed, "launch", fake_launch)
    monkeypatch.setattr(gpu_speed, "start_dry_run", lambda *a: subprocess.Popen([sys.executable, "-c", ""]))
    monkeypatch.setattr(gpu_speed, "ensure_checkpoint", lambda *a: None)
    monkeypatch.setattr(gpu_speed, "collect", lambda repo, run, out, code, wall, dry: (code, wall))
    lines: list[str] = []
    start = time.time()
    [(code, wall)] = gpu_speed.run_all(Path("."), [RUN], 3, tmp_path, 2, False, 100, lines.append)
    assert code == 0 and wall < 60 and time.time() - start < 60
    assert any("step 3 logged; stopped before its end-of-run export" in line for line in lines)
    assert gpu_speed.steps_logged(tmp_path / RUN.config / "metrics.jsonl") == 3
    assert gpu_speed.steps_logged(tmp_path / "absent.jsonl") == 0


def test_default_runs_leave_out_configs_whose_engine_is_not_installed(monkeypatch) -> None:
    """The GPU machines carry one engine at a time: a default guard run leaves out (with a note)
    the configs whose vLLM or SGLang cannot be imported, instead of failing them."""
    import importlib.util

    repo = Path(__file__).resolve().parents[1]
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda n, *a: object() if n == "vllm" else (None if n == "sglang" else real(n, *a)),
    )
    values = {r.config: gpu_speed.config_values(repo, r) for r in gpu_speed.RUNS}
    assert gpu_speed.engines_not_installed(values["qwen2.5-1.5B-rlvr_megatron_sglang_2gpus"]) == ["sglang"]
    assert gpu_speed.engines_not_installed(values["qwen2.5-1.5B-rlvr_megatron_vllm_2gpus"]) == []
    assert gpu_speed.engines_not_installed(values["rlvr_megatron_2gpus"]) == []
