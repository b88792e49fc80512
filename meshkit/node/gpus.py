"""How many GPUs this node has, without importing torch (standard library only: the node agent's
doctor facts and ``meshkit env`` both ask)."""

from __future__ import annotations

import contextlib
import os

GPU_PROBE_TIMEOUT = 5.0


def gpu_count() -> int:
    """GPUs visible to this process: CUDA_VISIBLE_DEVICES when set, else the NVIDIA driver's /proc
    entries, else ``nvidia-smi -L``; 0 when there are none."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    with contextlib.suppress(OSError):
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    import shutil  # only on machines without the driver's /proc entries (CPU nodes mostly)
    import subprocess

    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        out = subprocess.run(
            [smi, "-L"], capture_output=True, text=True, timeout=GPU_PROBE_TIMEOUT, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))
