"""Peak memory of a worker's device and process, for the per-step ``memory/*`` metrics.

Colocated roles are separate processes on one GPU, so no single process's allocator knows the
GPU's peak. ``DeviceMemoryMonitor`` samples the device-wide used memory (what ``nvidia-smi``
shows: every process's allocations, caches and CUDA contexts) from a daemon thread; every worker on
a GPU runs one, and the pipeline takes the largest peak any of them saw for that GPU. A peak
shorter than the sampling interval can be missed, so each process also reports its own allocator
peaks, which are exact for that process.

    monitor = DeviceMemoryMonitor(torch.device("cuda", 0), interval_s=0.05)
    ...
    stats = memory_stats(torch.device("cuda", 0), monitor)   # and resets the peaks
"""

from __future__ import annotations

import resource
import sys
import threading

import torch

GIB = float(1 << 30)


class DeviceMemoryMonitor:
    """Largest device-wide used memory (bytes) seen since the last ``take_peak``."""

    def __init__(self, device: torch.device, interval_s: float = 0.05) -> None:
        self.device = device
        self.interval_s = interval_s
        self._peak = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="roll-memory-monitor", daemon=True)
        self._thread.start()

    def _used(self) -> int:
        free, total = torch.cuda.mem_get_info(self.device)
        return total - free

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def sample(self) -> int:
        used = self._used()
        with self._lock:
            self._peak = max(self._peak, used)
        return used

    def take_peak(self) -> int:
        """The peak since the last call (including now), and start a new window."""
        now = self.sample()
        with self._lock:
            peak, self._peak = self._peak, now
        return peak

    def stop(self) -> None:
        self._stop.set()


def memory_stats(device: torch.device, monitor: DeviceMemoryMonitor | None) -> dict[str, float]:
    """GiB: ``device_peak_used`` (sampled, every process on the GPU), this process's allocator
    ``peak_allocated`` / ``peak_reserved`` and ``allocated`` now (GPU), or its peak RSS (CPU).
    Resets the peaks, so each call covers the time since the previous one."""
    if device.type != "cuda":
        return {"peak_rss": _peak_rss_bytes() / GIB}
    stats = {
        "peak_allocated": torch.cuda.max_memory_allocated(device) / GIB,
        "peak_reserved": torch.cuda.max_memory_reserved(device) / GIB,
        "allocated": torch.cuda.memory_allocated(device) / GIB,
    }
    torch.cuda.reset_peak_memory_stats(device)
    if monitor is not None:
        stats["device_peak_used"] = monitor.take_peak() / GIB
    return stats


def _peak_rss_bytes() -> int:
    """The process's peak resident set since it started (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024
