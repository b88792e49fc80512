"""A node's view of a job's supervisors: the one running here (its pid file holds its pid and
its heartbeat), and this node's copy of the supervision record, written only by compare-and-set.
Both live in ``/tmp``: a reboot empties them, so a rebooted node has no supervisor and no copy,
which is the truth. Standard library only.

The heartbeat is a reading of this node's monotonic clock, written by the supervisor and read
here by the agent on the same clock: its age never depends on a wall clock that steps (NTP, an
admin's ``date``) or on another machine's. It beats from a thread of its own (``Heartbeat``).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from ..protocol import Supervision, SupervisorReply, SupervisorRequest
from ..quorum import keeps
from ..record import build
from . import procs, tmux
from .files import (
    check_dir,
    private_dir,
    read_text,
    supervision_copy,
    supervision_lock,
    supervisor_pid_file,
    supervisors_root,
    write_atomic,
)

BEAT_EVERY = 5.0  # seconds between heartbeats (well inside ops.supervision.STALE)
HUNG = 900.0  # seconds a loop may go without a step before its heartbeat stops: longer than
# any one step it takes (a relaunch's two 300 s waits, its stop and launch)
MAX_COPY = 262144  # characters of a supervision record this node stores: its membership names
# every node (4096 at most, the hostfile's bound), so tens of characters each


def register(job_id: str) -> None:
    """Called by the supervisor itself: this process supervises ``job_id`` here."""
    private_dir(supervisors_root())
    beat(job_id)


def beat(job_id: str) -> None:
    """The supervisor's heartbeat: its pid and this node's monotonic clock, in its pid file."""
    with contextlib.suppress(OSError):
        write_atomic(supervisor_pid_file(job_id), f"{os.getpid()}\n{time.monotonic()}\n")


@dataclass
class Heartbeat:
    """A supervisor's heartbeat, from a thread of its own every ``every`` s whatever the loop is
    doing: a relaunch (stop, health checks, launch, resync) may take longer than
    ``ops.supervision.STALE``, and another supervisor must not take it for a hung one and take
    the attempt over. The loop marks each step (``moved``); one that has not moved for ``hung``
    s is stuck past every bound its steps have, and then the beats stop, so it goes stale as a
    frozen one does."""

    job_id: str
    every: float = BEAT_EVERY
    hung: float = HUNG
    last_move: float = field(default_factory=time.monotonic)

    def moved(self) -> None:
        self.last_move = time.monotonic()

    @contextlib.contextmanager
    def beating(self) -> Iterator[Heartbeat]:
        register(self.job_id)
        done = threading.Event()

        def beat_on() -> None:
            while not done.wait(self.every):
                if time.monotonic() - self.last_move < self.hung:
                    beat(self.job_id)

        thread = threading.Thread(target=beat_on, name="heartbeat", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            done.set()
            thread.join()


def recorded_pid(text: str | None) -> int | None:
    """Pure: the pid a supervisor's pid file holds (its first line; None: unreadable, or no
    pid Linux gives)."""
    lines = (text or "").split()
    try:
        pid = int(lines[0])
    except (ValueError, IndexError):
        return None
    if not 0 < pid <= procs.PID_MAX:
        return None
    return pid


def recorded_beat(text: str | None) -> float | None:
    """Pure: the last beat a supervisor's pid file holds (its second line; None: none)."""
    lines = (text or "").split()
    try:
        return float(lines[1])
    except (ValueError, IndexError):
        return None


def flag_value(argv: list[str], flag: str) -> str | None:
    """Pure: the argument after ``flag`` in ``argv`` (None: absent)."""
    if flag not in argv[:-1]:
        return None
    return argv[argv.index(flag) + 1]


def supervises(argv: list[str], session: str, workdir: str) -> bool:
    """Pure: whether the command line ``argv`` is ``meshkit supervise`` of the job ``session``
    in ``workdir`` (the job's identity), as the keeper's check reads its job's directory in
    its command line: a pid file outlives its process, and the pid may now be another job's
    supervisor."""
    if "supervise" not in argv:
        return False
    return flag_value(argv, "--session") == session and flag_value(argv, "--workdir") == workdir


def supervisor_pid(request: SupervisorRequest) -> int | None:
    """The live supervisor of the request's job on this node: a process of this user's (a pid
    file outlives its process, and the pid may now be another user's)."""
    pid = recorded_pid(read_text(supervisor_pid_file(request.job_id), 128))
    if pid is None or pid == os.getpid() or not procs.alive(pid) or not procs.mine(pid):
        return None
    if not supervises(procs.cmdline(pid), request.session, request.workdir):
        return None
    return pid


def beat_age(job_id: str) -> float | None:
    """Seconds since the supervisor of ``job_id`` here last beat, on this node's monotonic
    clock (None: no beat; one ahead of the clock was written before a reboot)."""
    stamp = recorded_beat(read_text(supervisor_pid_file(job_id), 128))
    if stamp is None:
        return None
    age = time.monotonic() - stamp
    if age < 0:
        return None
    return age


def copy_of(text: str | None) -> Supervision | None:
    """Pure: the record a stored copy holds (None: none, or unreadable)."""
    try:
        return build(Supervision, json.loads(text or "null"), "supervision record")
    except ValueError:
        return None


def accepts(stored: str | None, record: Supervision, version: int) -> bool:
    """Pure: whether a node whose copy is ``stored`` keeps ``record``, written by one who read
    ``version`` (``quorum.keeps``; an unreadable copy counts as none)."""
    return keeps(copy_of(stored), record, version)


def _store(request: SupervisorRequest, record: Supervision) -> bool:
    """``record`` as this node's copy, if the node's rule (``accepts``) keeps it."""
    text = record.to_json()
    if len(text) > MAX_COPY:
        raise ValueError("a supervision record over 64 KiB")
    private_dir(supervisors_root())
    copy = supervision_copy(request.job_id)
    lock_flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW
    descriptor = os.open(supervision_lock(request.job_id), lock_flags, 0o600)
    with os.fdopen(descriptor, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one writer at a time on this node
        if not accepts(read_text(copy, MAX_COPY), record, request.version):
            return False
        write_atomic(copy, text)
        return True


def supervisor(request: SupervisorRequest) -> SupervisorReply:
    check_dir(supervisors_root())
    pid = supervisor_pid(request)
    pid_file = supervisor_pid_file(request.job_id)
    copy = supervision_copy(request.job_id)
    if request.action == "end":
        # A stop's record goes first, so a supervisor looking meanwhile ends by itself; it is
        # kept (a supervisor cut off from this stop must find it), where a train drops the copy.
        if request.record is not None:
            _store(request, request.record)
        left: list[int] = []
        if pid is not None:
            _, left = procs.end(lambda: [pid] if procs.alive(pid) else [])
        if request.tmux_session:
            tmux.kill_session(request.tmux_session)
        if not left:
            dropped = [pid_file] if request.record is not None else [pid_file, copy]
            for path in dropped:
                with contextlib.suppress(OSError):
                    os.unlink(path)
        return SupervisorReply(pid, None, left, copy_of(read_text(copy, MAX_COPY)))
    if request.action == "start" and pid is None:
        tmux.kill_session(request.tmux_session)
        tmux.new_session(request.tmux_session, request.argv)
    written = False
    if request.record is not None:
        written = _store(request, request.record)
    beat = beat_age(request.job_id) if pid is not None else None
    return SupervisorReply(pid, beat, [], copy_of(read_text(copy, MAX_COPY)), written)
