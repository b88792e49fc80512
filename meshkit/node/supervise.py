"""A node's view of a job's supervisors: the one running here (its pid file is its heartbeat),
and this node's copy of the supervision record, written only by compare-and-set. Both live in
``/tmp``: a reboot empties them, so a rebooted node has no supervisor and no copy, which is the
truth. Standard library only."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time

from ..protocol import Supervision, SupervisorReply, SupervisorRequest
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

MAX_COPY = 65536  # characters of a supervision record this node stores


def register(job_id: str) -> None:
    """Called by the supervisor itself: this process supervises ``job_id`` here."""
    private_dir(supervisors_root())
    write_atomic(supervisor_pid_file(job_id), f"{os.getpid()}\n")


def beat(job_id: str) -> None:
    """The supervisor's heartbeat: its pid file's mtime (read on this node's clock only)."""
    with contextlib.suppress(OSError):
        os.utime(supervisor_pid_file(job_id))


def supervisor_pid(job_id: str) -> int | None:
    """The live supervisor of ``job_id`` on this node."""
    return procs.recorded(supervisor_pid_file(job_id), "supervise")


def copy_of(text: str | None) -> Supervision | None:
    """Pure: the record a stored copy holds (None: none, or unreadable)."""
    try:
        return build(Supervision, json.loads(text or "null"), "supervision record")
    except ValueError:
        return None


def version_of(text: str | None) -> int:
    """Pure: a stored copy's version (0: none, or unreadable: any writer may replace it)."""
    copy = copy_of(text)
    return 0 if copy is None else copy.version


def supervisor(request: SupervisorRequest) -> SupervisorReply:
    check_dir(supervisors_root())
    pid = supervisor_pid(request.job_id)
    pid_file = supervisor_pid_file(request.job_id)
    copy = supervision_copy(request.job_id)
    if request.action == "end":
        left: list[int] = []
        if pid is not None:
            _, left = procs.end(lambda: [pid] if procs.alive(pid) else [])
        if request.tmux_session:
            tmux.kill_session(request.tmux_session)
        if not left:
            for path in (pid_file, copy):
                with contextlib.suppress(OSError):
                    os.unlink(path)
        return SupervisorReply(pid, None, left, None)
    if request.action == "start" and pid is None:
        tmux.kill_session(request.tmux_session)
        tmux.new_session(request.tmux_session, request.argv)
    written = False
    if request.record is not None:
        text = request.record.to_json()
        if len(text) > MAX_COPY:
            raise ValueError("a supervision record over 64 KiB")
        private_dir(supervisors_root())
        lock_flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW
        descriptor = os.open(supervision_lock(request.job_id), lock_flags, 0o600)
        with os.fdopen(descriptor, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one writer at a time on this node
            if version_of(read_text(copy)) <= request.version:
                write_atomic(copy, text)
                written = True
    beat_age = None
    if pid is not None:
        with contextlib.suppress(OSError):
            beat_age = max(0.0, time.time() - os.stat(pid_file).st_mtime)
    return SupervisorReply(pid, beat_age, [], copy_of(read_text(copy)), written)
