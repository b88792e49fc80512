"""A sandbox node's own kernel log: a file in its node directory (root's, mode 0600: another
user may not read it, as /dev/kmsg under kernel.dmesg_restrict=1) that the node sees at
/dev/kmsg, and the records a fault appends to it in /dev/kmsg's format,
``PRI,SEQ,USEC,-;MESSAGE``: USEC the monotonic clock's microseconds (the kernel's timestamp
since boot), SEQ one more than the last record's."""

from __future__ import annotations

import os
import time
from pathlib import Path

from ..health import XID_MEANING

WARNING = 4  # an XID's priority (KERN_WARNING)
ERROR = 3  # an OOM kill's (KERN_ERR)
MODE = 0o600


def record(priority: int, sequence: int, usec: int, message: str) -> str:
    """One /dev/kmsg record, its newline included."""
    return f"{priority},{sequence},{usec},-;{message}\n"


def xid_message(code: int, pci: str, pid: int, process: str) -> str:
    """The NVIDIA driver's line for XID ``code`` on the GPU at ``pci`` (``0000:3b:00``)."""
    meaning = XID_MEANING.get(code, "unknown error")
    text = meaning[:1].upper() + meaning[1:]
    return f"NVRM: Xid (PCI:{pci}): {code}, pid={pid}, name={process}, {text}."


def oom_message(pid: int, process: str) -> str:
    """The kernel's line for an out-of-memory kill of ``pid``."""
    return (
        f"Out of memory: Killed process {pid} ({process}) total-vm:8388608kB, "
        "anon-rss:8126464kB, file-rss:0kB, shmem-rss:0kB, UID:0 pgtables:16384kB oom_score_adj:0"
    )


def next_sequence(text: str) -> int:
    """The sequence number after the last record of ``text`` (0 for an empty log)."""
    last = -1
    for line in text.splitlines():
        head = line.split(";", 1)[0].split(",")
        if len(head) >= 3 and head[1].isdigit():
            last = max(last, int(head[1]))
    return last + 1


def monotonic_usec() -> int:
    return int(time.clock_gettime(time.CLOCK_MONOTONIC) * 1_000_000)


def create(path: Path) -> None:
    """An empty kernel log (a booting node's), root's alone."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, MODE)
    os.close(descriptor)
    os.chmod(path, MODE)


def append(path: Path, priority: int, message: str) -> str:
    """Append ``message`` as the log's next record, in one write; returns the record."""
    text = path.read_text(errors="replace")
    line = record(priority, next_sequence(text), monotonic_usec(), message)
    descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW)
    try:
        os.write(descriptor, line.encode())
    finally:
        os.close(descriptor)
    return line
