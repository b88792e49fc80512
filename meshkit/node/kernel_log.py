"""This node's kernel log as health reads it: NVIDIA XID events and out-of-memory kills, from
``/dev/kmsg`` (the records ``dmesg`` reads). Standard library only.

The device is opened anew for each read and read to its end: a fresh descriptor starts at the
oldest record the kernel still holds, a would-block or an empty read is the end, and EPIPE says
a record was overwritten while it was read (the next read goes on). The real device gives one
record per read; the sandbox bind-mounts a regular file there, so a read is also split into
lines. The parsing is pure (``parse_records``, ``findings``), tested on recorded lines.
"""

from __future__ import annotations

import errno
import os
import re
import time
from dataclasses import dataclass, field

from ..health import Finding, HealthState, xid_meaning, xid_state

KMSG = "/dev/kmsg"
MAX_BYTES = 8 << 20  # the most one health read takes of the kernel log
MAX_SECONDS = 2.0  # and the longest it spends there
READ_SIZE = 16384  # more than one record's most (the kernel's refuses a smaller buffer)
MAX_FINDINGS = 20  # distinct XIDs and kills one reply names
UNREADABLE = "not readable by this user (kernel.dmesg_restrict): run as root or set it to 0"

XID = re.compile(r"NVRM: Xid \(([^)]{1,64})\): (\d{1,5})\b")
OOM_KILLED = re.compile(r"[Oo]ut of memory: Killed process (\d+) \(([^)]{0,64})\)(.*)")
OOM_UID = re.compile(r"\bUID:(\d+)")
OOM_KILL = re.compile(r"oom-kill:.*\btask=([^,]{0,64}),pid=(\d+),uid=(\d+)")


@dataclass(frozen=True)
class KernelRecord:
    """One kernel log record: its time (CLOCK_MONOTONIC seconds) and its message."""

    monotonic: float
    message: str


@dataclass(frozen=True)
class KernelRead:
    """What one read of the kernel log gave: its lines, or why it could not be read."""

    lines: list[str] = field(default_factory=list)
    error: str | None = None


def parse_records(lines: list[str]) -> list[KernelRecord]:
    """Pure: ``PRI,SEQ,USEC,FLAGS;message`` lines as records. A continuation line (it starts
    with a space: a record's key=value dictionary) and a line of another shape are skipped."""
    records = []
    for line in lines:
        if not line or line.startswith(" "):
            continue
        prefix, separator, message = line.partition(";")
        if not separator:
            continue
        parts = prefix.split(",")
        if len(parts) < 3 or not parts[2].isdigit():
            continue
        records.append(KernelRecord(int(parts[2]) / 1e6, message.rstrip("\n")))
    return records


def wall_time(monotonic: float, now: float, now_monotonic: float) -> float:
    """Pure: a CLOCK_MONOTONIC reading as a wall time, by the clocks read together now."""
    return now - (now_monotonic - monotonic)


@dataclass
class _Seen:
    """One XID (code and GPU) or kill, and how often and when last it was seen."""

    finding: Finding
    times: int = 1


def findings(
    records: list[KernelRecord], uid: int, window: float, now: float, now_monotonic: float
) -> list[Finding]:
    """Pure: the XIDs (``xid:N``, in ``meshkit.health``'s table) and the out-of-memory kills
    of ``uid``'s processes (``oom``, noted only: the application's own) newer than ``window``
    seconds, each XID of one GPU once (with how often), each kill once."""
    seen: dict[tuple[str, str], _Seen] = {}
    for record in records:
        when = wall_time(record.monotonic, now, now_monotonic)
        if now - when > window:
            continue
        found = _xid(record.message, when)
        if found is None:
            found = _oom(record.message, when, uid)
        if found is None:
            continue
        key, finding = found
        if key in seen:
            seen[key].times += 1
            seen[key].finding = finding
        elif len(seen) < MAX_FINDINGS:
            seen[key] = _Seen(finding)
    result = []
    for item in seen.values():
        finding = item.finding
        if item.times > 1 and finding.code.startswith("xid:"):
            finding = Finding(
                finding.source,
                finding.state,
                finding.code,
                f"{finding.what} ({item.times} times)",
                finding.time,
            )
        result.append(finding)
    return result


def _xid(message: str, when: float) -> tuple[tuple[str, str], Finding] | None:
    match = XID.search(message)
    if match is None:
        return None
    device = match.group(1)
    code = int(match.group(2))
    what = f"XID {code} on {device}: {xid_meaning(code)}"
    finding = Finding("kernel", xid_state(code), f"xid:{code}", what, when)
    return (f"xid:{code}", device), finding


def _oom(message: str, when: float, uid: int) -> tuple[tuple[str, str], Finding] | None:
    """A kill of ``uid``'s process (a line that does not say whose is taken as ours)."""
    killed = OOM_KILLED.search(message)
    if killed is not None:
        pid = killed.group(1)
        name = killed.group(2)
        owner = OOM_UID.search(killed.group(3))
        if owner is not None and int(owner.group(1)) != uid:
            return None
    else:
        kill = OOM_KILL.search(message)
        if kill is None or int(kill.group(3)) != uid:
            return None
        name = kill.group(1)
        pid = kill.group(2)
    what = f"out of memory: the kernel killed process {pid} ({name})"
    return ("oom", pid), Finding("kernel", HealthState.OK, "oom", what, when)


def read_kernel_log(
    path: str = KMSG, max_bytes: int = MAX_BYTES, max_seconds: float = MAX_SECONDS
) -> KernelRead:
    """The kernel log's lines, read to its end (at most ``max_bytes``, ``max_seconds``)."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        return KernelRead([], _why(exc))
    chunks: list[bytes] = []
    taken = 0
    deadline = time.monotonic() + max_seconds
    try:
        while taken < max_bytes and time.monotonic() < deadline:
            try:
                chunk = os.read(descriptor, READ_SIZE)
            except BlockingIOError:
                break  # EAGAIN: the end
            except OSError as exc:
                if exc.errno == errno.EPIPE:
                    continue  # a record overwritten while we read: the next is there
                return KernelRead([], _why(exc))
            if not chunk:
                break
            chunks.append(chunk)
            taken += len(chunk)
    finally:
        os.close(descriptor)
    text = b"".join(chunks).decode(errors="replace")
    return KernelRead(text.splitlines())


def _why(exc: OSError) -> str:
    if exc.errno in (errno.EACCES, errno.EPERM):
        return UNREADABLE
    return exc.strerror or str(exc)


def kernel_findings(
    window: float, path: str = KMSG, uid: int | None = None
) -> tuple[list[Finding], str | None]:
    """The kernel log's findings over the last ``window`` seconds, and why it could not be
    read (None: it was)."""
    read = read_kernel_log(path)
    if read.error is not None:
        return [], read.error
    owner = os.getuid() if uid is None else uid
    records = parse_records(read.lines)
    return findings(records, owner, window, time.time(), time.monotonic()), None
