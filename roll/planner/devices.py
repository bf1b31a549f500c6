"""Device memory the plan is checked against: the ``device_memory_gib`` key, a known GPU named by
``gpu``, or (at launch, with CUDA) what the first visible device reports."""

from __future__ import annotations

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
        try:
            import torch

            if torch.cuda.is_available():
                total = torch.cuda.mem_get_info(0)[1]
                return total, f"{torch.cuda.get_device_name(0)} (detected)"
        except (ImportError, RuntimeError):
            pass
    return None, "unknown (set gpu: H100|H200|... or device_memory_gib to check the fit)"
