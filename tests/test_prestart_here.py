"""Where the launcher starts Ray while it checks the config (``prestarts_here``): on CPU slots, and
for a GPU config only where its GPUs can be (a Ray cluster to join, or NVIDIA devices here). A GPU
config launched on a machine with neither used to start a private Ray on a thread that a stale or
dying Ray on the machine could hold in its GCS connection for good, so the launch never returned."""

from __future__ import annotations

from types import SimpleNamespace

from roll.launch import rlvr


def no_gpu_here(monkeypatch, tmp_path):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(rlvr, "NVIDIA_MARKERS", (str(tmp_path / "absent"),))
    monkeypatch.setattr(rlvr.shutil, "which", lambda name: None)


def test_cpu_configs_always_prestart(monkeypatch, tmp_path):
    no_gpu_here(monkeypatch, tmp_path)
    assert rlvr.prestarts_here(SimpleNamespace(device="cpu"))


def test_gpu_configs_prestart_only_where_their_gpus_can_be(monkeypatch, tmp_path):
    gpu = SimpleNamespace(device="cuda")
    no_gpu_here(monkeypatch, tmp_path)
    assert not rlvr.prestarts_here(gpu)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert rlvr.prestarts_here(gpu)
    monkeypatch.delenv("RAY_ADDRESS")
    (tmp_path / "nvidiactl").touch()
    monkeypatch.setattr(rlvr, "NVIDIA_MARKERS", (str(tmp_path / "nvidiactl"),))
    assert rlvr.prestarts_here(gpu)
    no_gpu_here(monkeypatch, tmp_path)
    monkeypatch.setattr(
        rlvr.shutil, "which", lambda name: "/usr/bin/nvidia-smi" if name == "nvidia-smi" else None
    )
    assert rlvr.prestarts_here(gpu)


def test_ray_starts_before_the_launcher_imports_torch():
    """What the launcher imports before ``prestart`` (the config loader, the launch timer, prestart
    itself) pulls in neither torch nor transformers: their import runs beside Ray's start."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import roll.launch.rlvr, roll.configs.loader, roll.pipeline.rlvr.perf, roll.pipeline.rlvr.prestart\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
