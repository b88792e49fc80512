"""This node's health (``meshkit.health``): each source read, bounded in time and bytes, and
judged. Standard library only.

The sources: the GPUs (``gpu_health``: NVML, else nvidia-smi), the kernel log
(``kernel_log``: XIDs, out-of-memory kills), InfiniBand ports (``infiniband``) and the free
space of the workdir's and the state directory's file systems. A source that cannot be read
is named with why (``SourceRead.error``), which makes the node ``unknown``, never ``ok``.

A job's first read on this node is its baseline (``files.health_baseline``): the GPUs it saw
and the InfiniBand error counters; fewer GPUs, or counters risen since, are findings.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field

from ..health import Finding, HealthLimits, HealthState, NodeHealth, SourceRead, judge
from ..protocol import HealthReply, HealthRequest
from . import files
from .gpu_readings import NvmlError
from .infiniband import INFINIBAND, IbPort, ports
from .kernel_log import KMSG, kernel_findings

MIB = 1 << 20
MAX_BASELINE = 65536


@dataclass
class Baseline:
    """What this node first read for a job: its GPU count (None: none read yet) and each
    InfiniBand error counter ("mlx5_0:1 link_downed" -> value)."""

    gpus: int | None = None
    counters: dict[str, int] = field(default_factory=dict)


def parse_baseline(text: str | None) -> Baseline:
    """Pure: a baseline file's JSON (anything else: an empty baseline)."""
    try:
        data = json.loads(text or "{}")
    except ValueError:
        return Baseline()
    if not isinstance(data, dict):
        return Baseline()
    gpus = data.get("gpus")
    counters = data.get("counters")
    if not isinstance(counters, dict):
        counters = {}
    kept = {
        str(key): value
        for key, value in counters.items()
        if isinstance(value, int) and not isinstance(value, bool)
    }
    if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 0:
        gpus = None
    return Baseline(gpus, kept)


def baseline_json(baseline: Baseline) -> str:
    return json.dumps({"gpus": baseline.gpus, "counters": baseline.counters}, sort_keys=True)


def load_baseline(job_id: str) -> Baseline | None:
    """The job's baseline here (None: no job, or a state directory meshkit must not use)."""
    if not job_id:
        return None
    try:
        files.check_job_id(job_id)
        files.private_dir(files.health_root())
    except (ValueError, OSError, files.UnsafeStateDir):
        return None
    return parse_baseline(files.read_text(files.health_baseline(job_id), MAX_BASELINE))


def save_baseline(job_id: str, baseline: Baseline) -> None:
    """Best effort: a baseline not kept only means the next read starts one anew."""
    with contextlib.suppress(ValueError, OSError):
        files.write_atomic(files.health_baseline(job_id), baseline_json(baseline))


# ---- InfiniBand


def ib_findings(found: list[IbPort], baseline: Baseline | None) -> list[Finding]:
    """Pure: a port not ``ACTIVE`` is unhealthy (``ib:down``); an error counter risen above
    ``baseline`` degraded (``ib:errors``). ``baseline`` takes in counters it had not seen, and
    a counter that went down (reset) as it is now."""
    result = []
    for port in found:
        if port.state != "ACTIVE":
            what = f"{port.name} is {port.state or 'in no state'}, not ACTIVE"
            result.append(Finding("infiniband", HealthState.UNHEALTHY, "ib:down", what))
        if baseline is None:
            continue
        risen = []
        for name, value in port.counters.items():
            key = f"{port.name} {name}"
            before = baseline.counters.get(key)
            if before is None or value < before:
                baseline.counters[key] = value
            elif value > before:
                risen.append(f"{name} {before}->{value}")
        if risen:
            what = f"{port.name}: {', '.join(risen)}"
            result.append(Finding("infiniband", HealthState.DEGRADED, "ib:errors", what))
    return result


# ---- free space


def free_mib(path: str) -> float:
    info = os.statvfs(path)
    return info.f_bavail * info.f_frsize / MIB


def disk_findings(paths: list[str], min_free_mib: int) -> tuple[list[Finding], str | None]:
    """Each path's file system with less than ``min_free_mib`` MiB free (``disk:full``), and
    why some path could not be looked at (None: each was)."""
    result = []
    errors = []
    for path in paths:
        try:
            free = free_mib(path)
        except OSError as exc:
            errors.append(f"{path}: {exc.strerror or exc}")
            continue
        if free < min_free_mib:
            what = f"{path}: {free:.0f} MiB free, below {min_free_mib} MiB"
            result.append(Finding("disk", HealthState.UNHEALTHY, "disk:full", what))
    return result, "; ".join(errors) or None


def state_dir() -> str:
    """This user's state directory, or the directory it would be made in while it is not."""
    root = files.state_root()
    if os.path.isdir(root):
        return root
    return os.path.dirname(root)


# ---- the GPUs


def gpu_source(expected: int | None, baseline: Baseline | None) -> tuple[list[Finding], SourceRead]:
    from .gpu_health import gpu_findings, read_gpu_health

    try:
        read = read_gpu_health()
    except NvmlError as exc:
        return [], SourceRead("gpu", "nvml", str(exc)[:300])
    if not read.via:
        return [], SourceRead("gpu", "", None)  # no driver: nothing to read
    wanted = expected
    if baseline is not None:
        if baseline.gpus is None:
            baseline.gpus = len(read.gpus)
        wanted = max(expected or 0, baseline.gpus) or None
    return gpu_findings(read.gpus, wanted), SourceRead("gpu", read.via)


def read_health(
    request: HealthRequest, kmsg: str = KMSG, infiniband: str = INFINIBAND
) -> NodeHealth:
    """This node's health for ``request`` (its job's workdir, the GPUs expected, the limits)."""
    limits: HealthLimits = request.limits
    baseline = load_baseline(request.job_id)
    before = None if baseline is None else baseline_json(baseline)
    findings: list[Finding] = []
    sources: list[SourceRead] = []

    found, read = gpu_source(request.gpus, baseline)
    findings += found
    sources.append(read)

    kernel, why = kernel_findings(limits.xid_window, kmsg)
    findings += kernel
    sources.append(SourceRead("kernel", kmsg, why))

    if os.path.isdir(infiniband):
        findings += ib_findings(ports(infiniband), baseline)
        sources.append(SourceRead("infiniband", infiniband))
    else:
        sources.append(SourceRead("infiniband", ""))  # none here: nothing to read

    paths = [path for path in (request.workdir, state_dir()) if path]
    disk, why = disk_findings(paths, limits.min_free_mib)
    findings += disk
    sources.append(SourceRead("disk", "statvfs", why))

    if baseline is not None and baseline_json(baseline) != before:
        save_baseline(request.job_id, baseline)
    return judge(findings, sources)


def health(request: HealthRequest) -> HealthReply:
    """The ``health`` op."""
    return HealthReply(read_health(request))
