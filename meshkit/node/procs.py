"""This node's processes, read from /proc: the process tree under a job's keeper, and the processes
that carry a job's tag. Standard library only.

A job's keeper is a child subreaper (``PR_SET_CHILD_SUBREAPER``): whatever the job starts stays
in the keeper's tree, even after ``setsid``, a double fork or ``env -i`` (which sheds the tag), so
the tree is what ``stop`` ends and checks. The tag (``MESHKIT_JOB`` in the environment) catches
what outlived its keeper.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable

from . import signals
from .files import read_text

JOB_TAG = "MESHKIT_JOB"  # every process of a job inherits it (unless it clears its environment)
SESSION_TAG = "MESHKIT_SESSION"  # the user's session name, for scripts that want it
PR_SET_CHILD_SUBREAPER = 36
TERM_GRACE = 5.0  # seconds the processes get after TERM, before KILL
KILL_GRACE = 2.0  # seconds KILL is repeated to what is still alive
POLL = 0.05  # seconds between looks
PID_MAX = 1 << 22  # Linux's largest pid_max: a larger number in a pid file is no pid


def become_subreaper() -> bool:
    """Make orphaned descendants re-parent to this process instead of init (Linux >= 3.4)."""
    import ctypes  # only the keeper asks, once

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def parents() -> dict[int, int]:
    """pid -> parent pid, for every process visible here."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        fields = _stat(name).split()
        if len(fields) > 1 and fields[1].isdigit():
            table[int(name)] = int(fields[1])
    return table


def _stat(pid: int | str) -> str:
    """``/proc/PID/stat`` after ``(comm)``: "state ppid ..." ('' when the process is gone). comm
    may hold spaces and parentheses: the fields start after the last ')'."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            stat = handle.read()
    except OSError:
        return ""
    return stat[stat.rfind(")") + 2 :]


def descendants(root: int, table: dict[int, int] | None = None) -> list[int]:
    """Every process below ``root`` (not ``root`` itself)."""
    table = parents() if table is None else table
    children: dict[int, list[int]] = {}
    for pid, parent in table.items():
        children.setdefault(parent, []).append(pid)
    found = []
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def tagged(job_id: str) -> list[int]:
    """Processes whose environment carries this job's tag (except this process)."""
    tag = f"{JOB_TAG}={job_id}".encode()
    this_process = os.getpid()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == this_process:
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as handle:
                if tag in handle.read().split(b"\0"):
                    found.append(int(name))
        except OSError:
            continue
    return found


def alive(pid: int) -> bool:
    """Running (a zombie, already dead and waiting to be reaped, does not count)."""
    return _stat(pid)[:1] not in ("", "Z", "X")


def owner(pid: int) -> int | None:
    """The uid that owns the process ``pid`` (its /proc directory's; None: gone)."""
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def mine(pid: int) -> bool:
    """Whether ``pid`` is a process of this user: a pid file names a number, and another
    user's process (the pid reused) is never taken for ours, nor signalled as ours."""
    return owner(pid) == os.getuid()


def in_group(group: int) -> list[int]:
    """The live processes of process group ``group`` (zombies do not count: where init does not
    reap, an ended group's orphans stay zombies, and ``killpg(group, 0)`` still finds them)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        fields = _stat(name).split()
        if len(fields) > 2 and fields[2] == str(group) and fields[0] not in ("Z", "X"):
            found.append(int(name))
    return found


def recorded(path: str, *marks: str) -> int | None:
    """The live process of this user (not this one) whose pid the file ``path`` holds, if each
    of ``marks`` is one of its command line's arguments: pids get reused."""
    try:
        pid = int((read_text(path, 64) or "").strip())
    except ValueError:
        return None
    if not 0 < pid <= PID_MAX or pid == os.getpid() or not alive(pid) or not mine(pid):
        return None
    if not set(marks) <= set(cmdline(pid)):
        return None
    return pid


def cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            raw = handle.read()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def signal_all(pids: Iterable[int], number: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, number)
        except (ProcessLookupError, PermissionError):
            continue  # gone already


def end(find: Callable[[], list[int]]) -> tuple[int, list[int]]:
    """TERM what ``find()`` returns (looking again as new processes appear), then KILL what is
    left, then look once more. Returns how many were signalled and what is still alive."""

    def living() -> list[int]:
        return [pid for pid in find() if alive(pid)]

    seen: set[int] = set()
    deadline = time.monotonic() + TERM_GRACE
    while True:
        current = living()
        fresh = [pid for pid in current if pid not in seen]
        signal_all(fresh, signals.SIGTERM)
        seen.update(fresh)
        if not current or time.monotonic() > deadline:
            break
        time.sleep(POLL)
    deadline = time.monotonic() + KILL_GRACE
    while True:
        current = living()
        if not current or time.monotonic() >= deadline:
            break
        signal_all(current, signals.SIGKILL)
        seen.update(current)
        time.sleep(POLL)
    return len(seen), living()
