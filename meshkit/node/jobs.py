"""A node's side of jobs: start (in tmux, under a keeper), status, stop, the jobs running here,
and log reads. Standard library only.

Each job has a state directory in this node's own /tmp (so a reboot forgets it: the job then
reads ``absent``); ``node/files.py`` names what it holds: the job's one record
(``protocol.NodeJob``, which the keeper runs), the keeper's pid, when the job started, its exit
code and, when the keeper could not start the job, why.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time

from .. import protocol
from ..record import EARLIEST_TIME, LATEST_TIME, asdict
from . import files, procs, tmux

KEEPER_START_TIMEOUT = 10.0  # the keeper writes its pid file within this after tmux starts it


class DamagedState(Exception):
    """A job's state file is there but does not hold what it should (another writer, a full
    disk): the node says so, rather than send what it read."""


def _read_number(path: str) -> float | None:
    """The finite number a state file holds (None: no file, or not such a number)."""
    try:
        number = float((files.read_text(path, 64) or "").strip())
    except ValueError:
        return None
    if not math.isfinite(number):  # float() reads "nan" and "inf", which no time or code is
        return None
    return number


def keeper_pid(job_id: str) -> int | None:
    """The job's keeper, if it is alive and really is that job's keeper."""
    directory = files.job_dir(job_id)
    return procs.recorded(files.keeper_pid_file(directory), "keep", directory)


def _spec(job_id: str, key: str) -> str | None:
    """A field of the job's spec as saved here (None when it is gone or unreadable)."""
    try:
        text = files.read_text(files.spec_file(files.job_dir(job_id)))
        value = json.loads(text or "{}").get(key)
    except (ValueError, AttributeError):
        return None
    if value is None:
        return None
    return str(value)


def running_jobs() -> list[protocol.RunningJob]:
    try:
        names = os.listdir(files.jobs_root())
    except OSError:
        return []
    job_ids = sorted(name for name in names if files.JOB_ID.match(name))
    running = []
    for job_id in job_ids:
        # Running means its command has not exited: stragglers an exited job left are no
        # conflict.
        state, _ = job_state(job_id)
        if state == protocol.JobState.RUNNING:
            label = _spec(job_id, "label") or job_id
            running.append(protocol.RunningJob(job_id, label))
    return running


def jobs(request: protocol.JobsRequest) -> protocol.JobsReply:
    files.check_state()  # the preflight asks every node this before anything is started
    return protocol.JobsReply(running_jobs())


def started_at(job_id: str) -> float | None:
    """When the keeper started the job's current attempt (by this node's clock); None before
    it has written it. A file that holds no such time is ``DamagedState``."""
    path = files.started_file(files.job_dir(job_id))
    started = _read_number(path)
    if started is not None and EARLIEST_TIME <= started <= LATEST_TIME:
        return started
    text = files.read_text(path, 64)
    if text is None:
        return None
    raise DamagedState(
        f"the job's state file {path} holds {text.strip()[:40]!r}, not a time: "
        "stop the job (meshkit stop) and start it again"
    )


def job_state(job_id: str) -> tuple[protocol.JobState, int | None]:
    code = _read_number(files.exit_file(files.job_dir(job_id)))
    if code is not None:
        return protocol.JobState.EXITED, int(code)
    if keeper_pid(job_id) is not None:
        return protocol.JobState.RUNNING, None
    return protocol.JobState.ABSENT, None


def stop(request: protocol.StopRequest) -> protocol.StopReply:
    """End a job's whole tree: its descendants first (while the keeper still holds them), then
    the keeper, then whatever still carries the tag; then look again."""
    job_id = request.job_id
    directory = files.job_dir(job_id)
    files.check_dir(directory)
    keeper = keeper_pid(job_id)
    tmux_session = _spec(job_id, "tmux_session")

    def below() -> list[int]:
        if keeper:
            return procs.descendants(keeper)
        return []

    def the_keeper() -> list[int]:
        if keeper and procs.alive(keeper):
            return [keeper]
        return []

    signalled, _ = procs.end(lambda: below() + procs.tagged(job_id))
    if keeper:
        signalled_keeper, _ = procs.end(the_keeper)
        signalled += signalled_keeper
    if tmux_session:
        tmux.kill_session(tmux_session)
    candidates = procs.tagged(job_id)
    if keeper:
        candidates.append(keeper)
    left = [pid for pid in candidates if procs.alive(pid)]
    found = keeper is not None or signalled > 0
    if not left:
        # keep_exit: the job stays "exited" with the code its command ended with (143 when the
        # TERM above ended it), so status still shows the last attempt's codes.
        if request.keep_exit:
            stale = [files.keeper_pid_file(directory)]
        else:
            stale = [
                files.exit_file(directory),
                files.started_file(directory),
                files.keeper_pid_file(directory),
                files.error_file(directory),
            ]
        for path in stale + flight_files_left():
            with contextlib.suppress(OSError):
                os.unlink(path)
    return protocol.StopReply(found, signalled, left)


def flight_files_left() -> list[str]:
    """The flight-recorder FIFOs and dumps (the rank hook's) of processes now gone."""
    root = files.state_root()
    try:
        names = os.listdir(root)
    except OSError:
        return []
    gone = []
    for name in names:
        pid = files.flight_file_pid(name)
        if pid is not None and pid.isdigit() and not procs.alive(int(pid)):
            gone.append(f"{root}/{name}")
    return gone


def fenced_here(request: protocol.StartRequest) -> str | None:
    """Why this node refuses to start a supervised job's attempt (None: it does not): its copy
    of the supervision record holds the stop of that launch, a newer generation of it, or a
    later launch. A stop kept by this node beats a relaunch that read the record before it."""
    if not request.launch:
        return None
    from ..quorum import newer_launch
    from .supervise import MAX_COPY, copy_of

    copy = copy_of(files.read_text(files.supervision_copy(request.job.job_id), MAX_COPY))
    if copy is None:
        return None
    if newer_launch(copy.launch, request.launch):
        return "the job was started anew here (a later train): this attempt is not started"
    if copy.launch != request.launch:
        return None
    if copy.supervisor == protocol.SupervisorState.STOPPED:
        return "the job was stopped (meshkit stop): this attempt is not started"
    if copy.generation > request.generation:
        return (
            f"generation {copy.generation} holds this node: an attempt of generation "
            f"{request.generation} is not started"
        )
    return None


def start(request: protocol.StartRequest) -> protocol.StartReply:
    """Start the job here unless another meshkit job runs (and ``replace`` was not given);
    the same job's old run is replaced. Then look: is its keeper up (or has it already exited)?"""
    job = request.job
    files.check_state()
    fenced = fenced_here(request)
    if fenced is not None:
        return protocol.StartReply(False, protocol.JobState.ABSENT, [], [], fenced)
    others = [running for running in running_jobs() if running.job_id != job.job_id]
    if others and not request.replace:
        conflict = "another meshkit job is running here"
        return protocol.StartReply(False, protocol.JobState.ABSENT, [], others, conflict)
    replaced: list[protocol.RunningJob] = []

    def failed(why: str) -> protocol.StartReply:
        return protocol.StartReply(False, protocol.JobState.ABSENT, replaced, [], why)

    victims: list[protocol.RunningJob] = []
    if request.replace:
        victims += others
    victims.append(protocol.RunningJob(job.job_id, job.label))  # and its own old run
    for victim in victims:
        ended = stop(protocol.StopRequest(victim.job_id))
        if ended.left:
            survivors = ended.left[:20]
            return failed(f"processes of {victim.label} survived TERM and KILL: {survivors}")
        if ended.found:
            replaced.append(victim)
    # The stop above left none of its files.
    directory = files.private_dir(files.job_dir(job.job_id))
    files.write_atomic(files.spec_file(directory), json.dumps(asdict(job)))
    tmux.kill_session(job.tmux_session)  # a stale one whose keeper is gone
    keeper = [sys.executable, "-m", "meshkit.node", "keep", directory]
    try:
        tmux.new_session(job.tmux_session, keeper)
    except tmux.TmuxError as exc:
        return failed(str(exc))
    deadline = time.monotonic() + KEEPER_START_TIMEOUT
    while time.monotonic() < deadline:
        state, _ = job_state(job.job_id)
        if state != protocol.JobState.ABSENT:
            error = files.read_text(files.error_file(directory), 2000)
            why: str | None = None
            if error:
                why = error.strip()
            return protocol.StartReply(True, state, replaced, [], why)
        time.sleep(0.02)
    return failed(f"the job's keeper did not start in {KEEPER_START_TIMEOUT:.0f}s")


def status(request: protocol.StatusRequest) -> protocol.StatusReply:
    files.check_dir(files.job_dir(request.job_id))
    state, code = job_state(request.job_id)
    started = None
    if state != protocol.JobState.ABSENT:
        started = started_at(request.job_id)
    last = last_line(request.log)
    ended = None
    if state == protocol.JobState.EXITED:
        ended = ended_at(request.job_id)
    health = None
    if request.health is not None:
        from .health import read_health  # only when asked: the supervisor's polls

        health = read_health(request.health)
    since = idle(request.log, started)
    progress = []
    if state == protocol.JobState.RUNNING:
        from .progress import read_progress  # a few small files, when the job runs

        progress = read_progress(files.job_dir(request.job_id), started, request.window)
    return protocol.StatusReply(
        state, code, started, last, since, health=health, ended=ended, progress=progress
    )


def ended_at(job_id: str) -> float | None:
    """When the job's exit record was written (its mtime, this node's clock)."""
    try:
        ended = os.stat(files.exit_file(files.job_dir(job_id))).st_mtime
    except OSError:
        return None
    if EARLIEST_TIME <= ended <= LATEST_TIME:
        return ended
    return None


def idle(path: str, started: float | None) -> float | None:
    """Seconds since ``path`` was last written or the job (re)started, whichever came later, by
    this node's clock: a relaunched job is not idle since its previous attempt's last line."""
    marks: list[float] = []
    with contextlib.suppress(OSError):
        marks.append(os.stat(path).st_mtime)
    if started is not None:
        marks.append(started)
    if not marks:
        return None
    return max(0.0, time.time() - max(marks))


def tail(path: str, window: int) -> list[str]:
    """The lines of the last ``window`` bytes of ``path`` (none when it cannot be read)."""
    try:
        with open(path, "rb") as handle:
            size = handle.seek(0, os.SEEK_END)
            handle.seek(max(0, size - window))
            return handle.read().decode(errors="replace").splitlines()
    except OSError:
        return []


def last_line(path: str) -> str | None:
    lines = [line for line in tail(path, 8192) if line.strip()]
    if not lines:
        return None
    return lines[-1][-300:]


def logs(request: protocol.LogsRequest) -> protocol.LogsReply:
    """The last lines, or what was appended since ``offset`` (at most MAX_LOG_BYTES a call)."""
    try:
        with open(request.path, "rb") as handle:
            size = handle.seek(0, os.SEEK_END)
            if request.offset is None:
                start = max(0, size - protocol.MAX_LOG_BYTES)
                handle.seek(start)
                data = handle.read(protocol.MAX_LOG_BYTES)
                lines = data.decode(errors="replace").splitlines()
                if start > 0 and lines:
                    lines = lines[1:]  # the first one is cut
                keep = max(0, min(request.lines, 100000))
                if not keep:
                    return protocol.LogsReply([], size)
                return protocol.LogsReply(lines[-keep:], size)
            offset = request.offset
            if offset > size:
                offset = 0  # the log was truncated: from its start
            handle.seek(offset)
            data = handle.read(protocol.MAX_LOG_BYTES)
    except OSError:
        return protocol.LogsReply([], request.offset or 0, missing=True)
    complete = data[: data.rfind(b"\n") + 1]  # whole lines only; the rest comes next time
    lines = complete.decode(errors="replace").splitlines()
    return protocol.LogsReply(lines, offset + len(complete))
