"""How many GPUs this node has, without importing torch (standard library only: the node agent's
doctor facts and ``meshkit env`` both ask)."""

from __future__ import annotations

import contextlib
import os
import stat

from ..trust import distrust, trusted_owners

GPU_PROBE_TIMEOUT = 5.0


def gpu_count() -> int:
    """GPUs visible to this process: CUDA_VISIBLE_DEVICES when set, else the NVIDIA driver's /proc
    entries, else ``nvidia-smi -L``; 0 when there are none."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        devices = [device.strip() for device in visible.split(",")]
        return len([device for device in devices if device and device != "-1"])
    with contextlib.suppress(OSError):
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    smi = _on_path("nvidia-smi")
    if smi is None:
        return 0
    import subprocess  # only where nvidia-smi is (`meshkit env` on CPU nodes skips the import)

    try:
        out = subprocess.run(
            [smi, "-L"], capture_output=True, text=True, timeout=GPU_PROBE_TIMEOUT, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def _on_path(name: str) -> str | None:
    """``shutil.which(name)`` for a plain name, without importing shutil (and its compressors),
    taking only a program ``trusted_program`` trusts: PATH may name a directory another user
    writes, and what is found there runs as this user (often root)."""
    for directory in os.environ.get("PATH", os.defpath).split(os.pathsep):
        path = os.path.join(directory or ".", name)
        if os.path.isfile(path) and os.access(path, os.X_OK) and trusted_program(path):
            return path
    return None


def trusted_program(path: str) -> bool:
    """Whether the driver's program or library at ``path`` may be run or loaded: a regular
    file that it and the directory holding it (where it could be swapped) are owned by this
    user or root and not writable by group or others (``trust.distrust``). A link is judged
    by the file it leads to."""
    real = os.path.realpath(path)
    try:
        info = os.stat(real)
        directory = os.stat(os.path.dirname(real))
    except OSError:
        return False
    if not stat.S_ISREG(info.st_mode):
        return False
    owners = trusted_owners()
    return distrust(info, owners) is None and distrust(directory, owners) is None
