"""A node's view of job supervisors: where a running supervisor registers itself, and ending it
(``stop`` ends the supervisor before the job, wherever it runs). Standard library only."""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path

from ..protocol import UnsuperviseReply, UnsuperviseRequest
from . import procs
from .files import write_atomic
from .jobs import JOB_ID

TMUX_TIMEOUT = 10.0


def supervisors_root() -> Path:
    return Path("/tmp") / f"meshkit-{os.getuid()}" / "supervisors"


def pid_file(job_id: str) -> Path:
    if not JOB_ID.match(job_id):
        raise ValueError(f"bad job id {job_id[:40]!r}")
    return supervisors_root() / f"{job_id}.pid"


def register(job_id: str) -> None:
    """Called by the supervisor itself: this process supervises ``job_id`` here."""
    path = pid_file(job_id)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    write_atomic(path, f"{os.getpid()}\n")


def supervisor_pid(job_id: str) -> int | None:
    """The live supervisor of ``job_id`` on this node (checked by its command line: pids get
    reused)."""
    try:
        pid = int(pid_file(job_id).read_text().strip())
    except (OSError, ValueError):
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
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            subprocess.run(
                ["tmux", "kill-session", "-t", f"={request.tmux_session}"],
                capture_output=True,
                timeout=TMUX_TIMEOUT,
                check=False,
            )
    if not left:
        with contextlib.suppress(OSError, ValueError):
            pid_file(request.job_id).unlink()
    return UnsuperviseReply(pid is not None, left)
