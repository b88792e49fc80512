"""A node's view of job supervisors: where a running supervisor registers itself, and ending it
(``stop`` ends the supervisor before the job, wherever it runs). Standard library only."""

from __future__ import annotations

import contextlib
import os

from ..protocol import UnsuperviseReply, UnsuperviseRequest
from . import jobs, procs, tmux
from .files import read_text, write_atomic


def supervisors_root() -> str:
    return f"/tmp/meshkit-{os.getuid()}/supervisors"


def pid_file(job_id: str) -> str:
    if not jobs.JOB_ID.match(job_id):
        raise ValueError(f"bad job id {job_id[:40]!r}")
    return os.path.join(supervisors_root(), f"{job_id}.pid")


def register(job_id: str) -> None:
    """Called by the supervisor itself: this process supervises ``job_id`` here."""
    path = pid_file(job_id)
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    write_atomic(path, f"{os.getpid()}\n")


def supervisor_pid(job_id: str) -> int | None:
    """The live supervisor of ``job_id`` on this node (checked by its command line: pids get
    reused)."""
    try:
        pid = int((read_text(pid_file(job_id), 64) or "").strip())
    except ValueError:
        return None
    if pid == os.getpid() or not procs.alive(pid):
        return None
    argv = procs.cmdline(pid)
    return pid if "supervise" in argv else None


def unsupervise(request: UnsuperviseRequest) -> UnsuperviseReply:
    pid = supervisor_pid(request.job_id)
    left: list[int] = []
    if pid is not None:
        _, left = procs.end(lambda: [pid] if procs.alive(pid) else [])
    if request.tmux_session:
        tmux.kill_session(request.tmux_session)
    if not left:
        with contextlib.suppress(OSError, ValueError):
            os.unlink(pid_file(request.job_id))
    return UnsuperviseReply(pid is not None, left)
