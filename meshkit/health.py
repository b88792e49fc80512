"""A node's health, pure: what its readers found (``Finding``), which sources they could read
(``SourceRead``), and the verdict over both (``judge``: ``ok``, ``degraded`` or ``unhealthy``).
The readers are the node's (``meshkit.node.health``); the supervisor, ``status``, ``top`` and the
doctor read the verdict. Standard library only: the node side imports this.

A source that could not be read (no NVML, a kernel log a non-root user may not read) is named in
``sources`` with why, and the verdict says so (``unread``): it is never counted as healthy.

NVIDIA's XID codes (``NVRM: Xid (PCI:...): N, ...`` in the kernel log), as NVIDIA's XID catalog
and the fleets' reports sort them:

- fatal to the node (``unhealthy``): the GPU or its memory cannot be trusted until it is reset
  or the node rebooted: 48 (double-bit ECC), 61/62 (internal micro-controller halt), 74 (NVLink
  error), 79 (GPU has fallen off the bus), 95 (uncontained ECC error), 109 (context switch
  timeout), 119/120 (GSP timeout or error), 140 (unrecovered ECC), 143/144-150 (GPU or NVLink
  fatal errors of recent drivers: 143 GPU initialization failure);
- degrading (``degraded``): the GPU goes on, but a memory page or row is being retired, or errors
  are frequent: 63/64 (page retirement or row remapping event or failure), 92 (high single-bit
  ECC rate), 94 (contained ECC error: the application that hit it was ended);
- the application's own (noted, the node stays ``ok``): 13 (graphics engine exception), 31 (GPU
  memory page fault: an illegal address), 43 (GPU stopped processing: the application's channel
  was reset), 45 (preemptive cleanup after an earlier error), 68 (video decoder exception), 69
  (graphics engine class error);
- any other code: ``degraded``, named as not in this table.
"""

from __future__ import annotations

from .record import Count, StrEnum, WallTime, field, record


class HealthState(StrEnum):
    """A node's verdict: ``ok``; ``unknown`` (nothing wrong was found, but some source could
    not be read: never counted as healthy, never evicted for); ``degraded``; ``unhealthy``."""

    OK = "ok"
    UNKNOWN = "unknown"
    DEGRADED = "degraded"
    UNHEALTHY = "unhealthy"


SEVERITY = {
    HealthState.OK: 0,
    HealthState.UNKNOWN: 1,
    HealthState.DEGRADED: 2,
    HealthState.UNHEALTHY: 3,
}

XID_FATAL = frozenset({48, 61, 62, 74, 79, 95, 109, 119, 120, 140, 143, 144, 145, 146, 147, 148})
XID_DEGRADING = frozenset({63, 64, 92, 94})
XID_APPLICATION = frozenset({13, 31, 43, 45, 68, 69})

# What the known codes mean, for the reasons people read.
XID_MEANING = {
    13: "graphics engine exception",
    31: "GPU memory page fault",
    43: "GPU stopped processing",
    45: "preemptive cleanup",
    48: "double-bit ECC error",
    61: "internal micro-controller breakpoint",
    62: "internal micro-controller halt",
    63: "ECC page retirement or row remapping event",
    64: "ECC page retirement or row remapping failure",
    68: "video decoder exception",
    69: "graphics engine class error",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    109: "context switch timeout",
    119: "GSP RPC timeout",
    120: "GSP error",
    140: "unrecovered ECC error",
    143: "GPU initialization failure",
}


def xid_state(code: int) -> HealthState:
    """What XID ``code`` makes of its node (the table above)."""
    if code in XID_FATAL:
        return HealthState.UNHEALTHY
    if code in XID_APPLICATION:
        return HealthState.OK
    return HealthState.DEGRADED


def xid_meaning(code: int) -> str:
    return XID_MEANING.get(code, "not in meshkit's XID table")


@record
class HealthLimits:
    """The thresholds a node's health is read with (config keys ``health_*``, saved with the
    job): below ``min_free_mib`` MiB free on the workdir's or the state directory's file system a
    node is unhealthy; XIDs and out-of-memory kills older than ``xid_window`` seconds are
    history, not health."""

    min_free_mib: Count = 1024
    xid_window: float = 3600.0


@record
class Finding:
    """One thing a reader found: its ``source`` ("gpu", "kernel", "infiniband", "disk"), what it
    makes of the node (``state``: ``ok`` is noted only, as an XID that is the application's
    own), a short ``code`` a program can match ("xid:79", "gpus:missing", "ecc:uncorrected",
    "remap:pending", "pcie:width", "throttle:thermal", "oom", "ib:down", "ib:errors", "disk:full"),
    what people read (``what``), and when it happened when the source says (``time``)."""

    source: str
    state: HealthState
    code: str
    what: str
    time: WallTime | None = None


@record
class SourceRead:
    """One source the readers tried: ``via`` what ("nvml", "nvidia-smi", "/dev/kmsg",
    "/sys/class/infiniband", "statvfs"; "" when there is nothing to read, no GPU driver, say),
    and ``error``: why it could not be read (None: it was)."""

    source: str
    via: str
    error: str | None = None


@record
class NodeHealth:
    """A node's verdict (``state``), the findings behind it, and each source tried."""

    state: HealthState
    findings: list[Finding] = field(default_factory=list)
    sources: list[SourceRead] = field(default_factory=list)

    @property
    def reasons(self) -> list[str]:
        """What made the node degraded or unhealthy, one line each ("kernel: XID 79 ..."),
        then each source that could not be read ("kernel: not read: ...")."""
        found = [
            f"{finding.source}: {finding.what}"
            for finding in self.findings
            if finding.state != HealthState.OK
        ]
        return found + [f"{read.source}: not read: {read.error}" for read in self.unread_sources]

    @property
    def unread_sources(self) -> list[SourceRead]:
        return [read for read in self.sources if read.error is not None]

    def as_json(self) -> dict[str, object]:
        """``status --json``'s, ``top --json``'s ``health``: the state and the reasons."""
        return {"state": str(self.state), "reasons": self.reasons}


def judge(findings: list[Finding], sources: list[SourceRead]) -> NodeHealth:
    """The node's verdict: its worst finding's state; with nothing wrong found, ``unknown``
    when some source could not be read, else ``ok``."""
    worst = HealthState.OK
    for finding in findings:
        if SEVERITY[finding.state] > SEVERITY[worst]:
            worst = finding.state
    if worst == HealthState.OK and any(read.error is not None for read in sources):
        worst = HealthState.UNKNOWN
    return NodeHealth(worst, list(findings), list(sources))


def at_least(health: NodeHealth, state: HealthState) -> bool:
    """Whether ``health`` is ``state`` or worse."""
    return SEVERITY[health.state] >= SEVERITY[state]


def words(health: NodeHealth) -> str:
    """One line for a table: "unhealthy: kernel: XID 79 ...", "ok", "unknown: kernel: not
    read: ..."."""
    text = str(health.state)
    reasons = health.reasons
    if reasons:
        text += ": " + "; ".join(reasons)
    return text
