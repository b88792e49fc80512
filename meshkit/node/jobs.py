"""A node's side of jobs: start (in tmux, under a keeper), status, stop, the jobs running here,
and log reads. Standard library only.

Each job has a state directory in this node's own /tmp (so a reboot forgets it: the job then
reads ``absent``): ``spec.json`` (the job's one record, ``protocol.NodeJob``, which the keeper
runs), ``keeper.pid``, ``started``, ``exit`` and, when the keeper could not start the job,
``error``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import time

from .. import protocol as p
from ..record import asdict
from . import procs, tmux
from .files import SPEC, read_text, state_root, write_atomic

KEEPER_START_TIMEOUT = 10.0  # the keeper writes keeper.pid within this after tmux starts it
JOB_ID = re.compile(r"^[0-9a-f]{8,64}$")


def jobs_root() -> str:
    return f"{state_root()}/jobs"


def state_dir(job_id: str) -> str:
    if not JOB_ID.match(job_id):
        raise ValueError(f"bad job id {job_id[:40]!r}")
    return f"{jobs_root()}/{job_id}"


def _read_number(path: str) -> float | None:
    """A number a state file holds (None: none, or not a number)."""
    try:
        return float((read_text(path, 64) or "").strip())
    except ValueError:
        return None


def keeper_pid(job_id: str) -> int | None:
    """The job's keeper, if it is alive and really is that job's keeper."""
    d = state_dir(job_id)
    return procs.recorded(f"{d}/keeper.pid", "keep", d)


def _spec(job_id: str, key: str) -> str | None:
    """A field of the job's spec as saved here (None when it is gone or unreadable)."""
    try:
        value = json.loads(read_text(f"{state_dir(job_id)}/{SPEC}") or "{}").get(key)
    except (ValueError, AttributeError):
        return None
    return None if value is None else str(value)


def running_jobs() -> list[p.RunningJob]:
    root = jobs_root()
    try:
        ids = sorted(name for name in os.listdir(root) if JOB_ID.match(name))
    except OSError:
        return []
    # Running means its command has not exited; stragglers an exited job left are not a conflict.
    return [
        p.RunningJob(i, _spec(i, "label") or i)
        for i in ids
        if job_state(i)[0] == p.JobState.RUNNING
    ]


def jobs(request: p.JobsRequest) -> p.JobsReply:
    return p.JobsReply(running_jobs())


def started_at(job_id: str) -> float | None:
    """When the keeper started the job's current attempt (by this node's clock)."""
    return _read_number(f"{state_dir(job_id)}/started")


def job_state(job_id: str) -> tuple[p.JobState, int | None]:
    d = state_dir(job_id)
    code = _read_number(f"{d}/exit")
    if code is not None:
        return p.JobState.EXITED, int(code)
    if keeper_pid(job_id) is not None:
        return p.JobState.RUNNING, None
    return p.JobState.ABSENT, None


def stop(request: p.StopRequest) -> p.StopReply:
    """End a job's whole tree: its descendants first (while the keeper still holds them), then
    the keeper, then whatever still carries the tag; then look again."""
    job_id = request.job_id
    keeper = keeper_pid(job_id)
    d = state_dir(job_id)
    tmux_session = _spec(job_id, "tmux_session")

    def below() -> list[int]:
        return procs.descendants(keeper) if keeper else []

    signalled, _ = procs.end(lambda: below() + procs.tagged(job_id))
    if keeper:
        more, _ = procs.end(lambda: [keeper] if procs.alive(keeper) else [])
        signalled += more
    if tmux_session:
        tmux.kill_session(tmux_session)
    left = [n for n in procs.tagged(job_id) + ([keeper] if keeper else []) if procs.alive(n)]
    found = keeper is not None or signalled > 0
    if not left:
        # keep_exit: the job stays "exited" with the code its command ended with (143 when the
        # TERM above ended it), so status still shows the last attempt's codes.
        stale = ("keeper.pid",) if request.keep_exit else ("exit", "started", "keeper.pid", "error")
        paths = [f"{d}/{name}" for name in stale] + flight_files_left()
        for path in paths:
            with contextlib.suppress(OSError):
                os.unlink(path)
    return p.StopReply(found, signalled, left)


def flight_files_left() -> list[str]:
    """The flight-recorder FIFOs and dumps (the rank hook's ``fr-PID``) of processes now gone."""
    with contextlib.suppress(OSError):
        names = [(n, n[3:].partition(".")[0]) for n in os.listdir(state_root())]
        gone = [
            n for n, pid in names if n[:3] == "fr-" and pid.isdigit() and not procs.alive(int(pid))
        ]
        return [f"{state_root()}/{n}" for n in gone]
    return []


def start(request: p.StartRequest) -> p.StartReply:
    """Start the job here unless another meshkit job runs (and ``replace`` was not given);
    the same job's old run is replaced. Then look: is its keeper up (or has it already exited)?"""
    job = request.job
    others = [r for r in running_jobs() if r.job_id != job.job_id]
    if others and not request.replace:
        return p.StartReply(
            False, p.JobState.ABSENT, [], others, "another meshkit job is running here"
        )
    replaced: list[p.RunningJob] = []

    def failed(why: str) -> p.StartReply:
        return p.StartReply(False, p.JobState.ABSENT, replaced, [], why)

    for victim in [*(others if request.replace else []), p.RunningJob(job.job_id, job.label)]:
        ended = stop(p.StopRequest(victim.job_id))
        if ended.left:
            return failed(f"processes of {victim.label} survived TERM and KILL: {ended.left[:20]}")
        if ended.found:
            replaced.append(victim)
    d = state_dir(job.job_id)  # the stop above left none of its files
    os.makedirs(d, mode=0o700, exist_ok=True)
    write_atomic(f"{d}/{SPEC}", json.dumps(asdict(job)))
    tmux.kill_session(job.tmux_session)  # a stale one whose keeper is gone
    try:
        tmux.new_session(job.tmux_session, [sys.executable, "-m", "meshkit.node", "keep", d])
    except tmux.TmuxError as exc:
        return failed(str(exc))
    deadline = time.monotonic() + KEEPER_START_TIMEOUT
    while time.monotonic() < deadline:
        state, _ = job_state(job.job_id)
        if state != p.JobState.ABSENT:
            error = read_text(f"{d}/error", 2000)
            return p.StartReply(True, state, replaced, [], error.strip() if error else None)
        time.sleep(0.02)
    return failed(f"the job's keeper did not start in {KEEPER_START_TIMEOUT:.0f}s")


def status(request: p.StatusRequest) -> p.StatusReply:
    state, code = job_state(request.job_id)
    started = started_at(request.job_id) if state != p.JobState.ABSENT else None
    return p.StatusReply(state, code, started, last_line(request.log), idle(request.log, started))


def idle(path: str, started: float | None) -> float | None:
    """Seconds since ``path`` was last written or the job (re)started, whichever came later, by
    this node's clock: a relaunched job is not idle since its previous attempt's last line."""
    try:
        marks = [os.stat(path).st_mtime]
    except OSError:
        marks = []
    marks += [started] if started is not None else []
    return max(0.0, time.time() - max(marks)) if marks else None


def tail(path: str, window: int) -> list[str]:
    """The lines of the last ``window`` bytes of ``path`` (none when it cannot be read)."""
    try:
        with open(path, "rb") as handle:
            handle.seek(max(0, handle.seek(0, os.SEEK_END) - window))
            return handle.read().decode(errors="replace").splitlines()
    except OSError:
        return []


def last_line(path: str) -> str | None:
    lines = [ln for ln in tail(path, 8192) if ln.strip()]
    return lines[-1][-300:] if lines else None


def logs(request: p.LogsRequest) -> p.LogsReply:
    """The last lines, or what was appended since ``offset`` (at most MAX_LOG_BYTES a call)."""
    try:
        with open(request.path, "rb") as handle:
            size = handle.seek(0, os.SEEK_END)
            if request.offset is None:
                start = max(0, size - p.MAX_LOG_BYTES)
                handle.seek(start)
                data = handle.read(p.MAX_LOG_BYTES)
                lines = data.decode(errors="replace").splitlines()
                if start > 0 and lines:
                    lines = lines[1:]  # the first one is cut
                keep = max(0, min(request.lines, 100000))
                return p.LogsReply(lines[-keep:] if keep else [], size)
            offset = request.offset if request.offset <= size else 0  # truncated: from the start
            handle.seek(offset)
            data = handle.read(p.MAX_LOG_BYTES)
    except OSError:
        return p.LogsReply([], request.offset or 0, missing=True)
    complete = data[: data.rfind(b"\n") + 1]  # whole lines only; the rest comes next time
    return p.LogsReply(complete.decode(errors="replace").splitlines(), offset + len(complete))


def port_free(port: int) -> bool:
    """Whether a TCP listener could bind ``port`` here (as torchrun's store will)."""
    import socket

    for family, addr in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                sock.bind((addr, port))
            return True
        except OSError as exc:
            if exc.errno == 98:  # EADDRINUSE
                return False
    return True
