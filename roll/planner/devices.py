"""Device memory the plan is checked against: the ``device_memory_gib`` key, a known GPU named by
``gpu``, or (at launch, with CUDA) what the first visible device reports."""

from __future__ import annotations

import os
import subprocess

from roll.configs.pipeline_config import RLVRConfig

GIB = 1 << 30
# Total memory as ``torch.cuda.mem_get_info`` reports it, GiB.
KNOWN_GPUS: dict[str, float] = {
    "H100": 79.2,  # H100 80 GB (SXM and PCIe)
    "H200": 140.4,  # H200 141 GB
    "H20": 95.6,
    "A100-80GB": 79.2,
    "A100-40GB": 39.4,
}


def device_capacity(config: RLVRConfig, probe: bool = True) -> tuple[int | None, str]:
    """(bytes per device, where that number comes from); (None, why) when unknown."""
    if config.device_memory_gib is not None:
        return int(config.device_memory_gib * GIB), f"device_memory_gib {config.device_memory_gib:g}"
    if config.gpu is not None:
        return int(KNOWN_GPUS[config.gpu] * GIB), f"gpu {config.gpu}"
    if probe:
        found = first_visible_gpu() or _torch_first_gpu()
        if found is not None:
            name, total = found
            return total, f"{name} (detected)"
    return None, "unknown (set gpu: H100|H200|... or device_memory_gib to check the fit)"


def first_visible_gpu() -> tuple[str, int] | None:
    """(name, total bytes) of the first visible GPU, asked of ``nvidia-smi`` so that the launching
    process opens no CUDA context (one would hold ~0.5 GiB of that GPU for the whole run and take
    a second or two to create); None without an NVIDIA GPU or driver tools."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and not visible.strip():
        return None
    first = visible.split(",")[0].strip() if visible else "0"
    query = ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits", "-i", first]
    try:
        out = subprocess.run(query, capture_output=True, text=True, timeout=20, check=True).stdout
        name, mib = out.strip().splitlines()[0].rsplit(",", 1)
        return name.strip(), int(float(mib)) << 20
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def _torch_first_gpu() -> tuple[str, int] | None:
    """The same through torch, where ``nvidia-smi`` is missing (this opens a CUDA context in the
    launching process, which ``first_visible_gpu`` avoids)."""
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0), torch.cuda.mem_get_info(0)[1]
    except (ImportError, RuntimeError):
        pass
    return None
