"""Node side, on this machine: a supervisor's pid file and heartbeat, and this node's record.

Ending a job's supervisor here, and this node's copy of the supervision record, written only by
compare-and-set. The supervisor's policy and loop are test_supervise (no nodes), supervised jobs
end to end test_supervised (sandbox)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Literal

import pytest

from meshkit.node import files
from meshkit.node import supervise as nsup
from meshkit.protocol import Supervision, SupervisorRequest, SupervisorState


def record(version: int, by: int = 0) -> Supervision:
    """A supervision record at ``version``, written by rank ``by``."""
    return Supervision(SupervisorState.RUNNING, 1, 2, version=version, by=by)


# A stand-in supervisor: it registers as the real one does, and its command line names
# ``supervise`` and its job's session and workdir, as the real one's does.
STAND_IN = """
import sys, time
from meshkit.node import files, supervise
files.supervisors_root = lambda: sys.argv[1]
supervise.register(sys.argv[2])
time.sleep(60)
"""


def stand_in(root: Path, job_id: str, session: str, workdir: str) -> subprocess.Popen[bytes]:
    """A registered stand-in supervisor of the job ``session`` in ``workdir``."""
    argv = [sys.executable, "-c", STAND_IN, str(root), job_id]
    argv += ["supervise", "--session", session, "--workdir", workdir]
    proc = subprocess.Popen(argv)
    pid_file = Path(files.supervisor_pid_file(job_id))
    deadline = time.monotonic() + 30
    while not pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return proc


def test_end_stops_only_the_registered_supervisor_and_drops_the_copy(tmp_path, monkeypatch):
    monkeypatch.setattr(files, "supervisors_root", lambda: str(tmp_path))
    job_id = "cd" * 8
    nsup.supervisor(SupervisorRequest(job_id, "", record=record(1), version=0))
    proc = stand_in(tmp_path, job_id, "s", "/w")
    try:
        look = nsup.supervisor(SupervisorRequest(job_id, "", session="s", workdir="/w"))
        assert look.pid == proc.pid
        assert look.beat is not None
        assert look.beat < 60
        reply = nsup.supervisor(SupervisorRequest(job_id, "", "end", session="s", workdir="/w"))
        assert reply.pid == proc.pid
        assert reply.left == []
        assert proc.wait(10) is not None
        assert not Path(files.supervisor_pid_file(job_id)).exists()
        again = nsup.supervisor(SupervisorRequest(job_id, ""))
        assert again.pid is None
        assert again.record is None  # the copy went with it
    finally:
        proc.kill()
        proc.wait()


def test_a_pid_file_naming_another_jobs_supervisor_ends_nothing(tmp_path, monkeypatch):
    """A stale pid file whose pid now belongs to another job's live supervisor (pids are
    reused): ``end`` (what ``stop`` asks) leaves that supervisor alive, and ``start`` starts
    this job's own instead of taking it for one."""
    monkeypatch.setattr(files, "supervisors_root", lambda: str(tmp_path))
    mine = "ab" * 8
    theirs = "ef" * 8
    proc = stand_in(tmp_path, theirs, "theirs", "/w")
    try:
        Path(files.supervisor_pid_file(mine)).write_text(f"{proc.pid}\n")
        for session, workdir in (("mine", "/w"), ("theirs", "/v")):
            look = nsup.supervisor(SupervisorRequest(mine, "", session=session, workdir=workdir))
            assert look.pid is None
        reply = nsup.supervisor(SupervisorRequest(mine, "", "end", session="mine", workdir="/w"))
        assert reply.pid is None
        time.sleep(0.5)
        assert proc.poll() is None  # alive
        look = nsup.supervisor(SupervisorRequest(theirs, "", session="theirs", workdir="/w"))
        assert look.pid == proc.pid
    finally:
        proc.kill()
        proc.wait()


def test_the_heartbeat_is_read_on_the_nodes_monotonic_clock():
    now = time.monotonic()
    assert nsup.recorded_pid(f"12\n{now}\n") == 12
    assert nsup.recorded_beat(f"12\n{now}\n") == now
    assert nsup.recorded_pid("12\n") == 12  # an older pid file: a pid, no beat
    assert nsup.recorded_beat("12\n") is None
    assert nsup.recorded_pid("junk") is None
    assert nsup.recorded_beat(None) is None
    argv = ["python", "-m", "meshkit", "supervise", "--session", "s", "--workdir", "/w"]
    assert nsup.supervises(argv, "s", "/w")
    assert not nsup.supervises(argv, "s", "/v")
    assert not nsup.supervises(argv, "t", "/w")
    assert not nsup.supervises(["python", "-m", "meshkit", "run", *argv[4:]], "s", "/w")
    assert not nsup.supervises([*argv[:-1]], "s", "/w")  # --workdir with no value


def test_the_record_copy_is_compare_and_set_on_its_version(tmp_path, monkeypatch):
    """Two writers that read version 1 both ask to write version 2: only the first wins; a copy
    that is missing or unreadable (a rebooted node) takes any write."""
    monkeypatch.setattr(files, "supervisors_root", lambda: str(tmp_path))
    job_id = "ef" * 8

    def put_(copy: Supervision, version: int) -> bool:
        request = SupervisorRequest(job_id, "", record=copy, version=version)
        return nsup.supervisor(request).written

    assert put_(record(1, by=0), 0)
    assert put_(record(2, by=1), 1)
    assert not put_(record(2, by=2), 1)
    assert nsup.supervisor(SupervisorRequest(job_id, "")).record == record(2, by=1)
    assert nsup.copy_of("not json") is None  # unreadable: counts as no copy (keeps any write)
    assert nsup.copy_of(None) is None
    Path(files.supervision_copy(job_id)).write_text("garbage")
    assert put_(record(3), 0)
    with pytest.raises(ValueError, match="bad job id"):
        nsup.supervisor(SupervisorRequest("../x", ""))


def test_a_stop_lands_over_any_copy_and_only_a_stop_replaces_it(tmp_path, monkeypatch):
    """A stop's record lands whatever the version it read; an ``end`` that carries it keeps it
    as the copy (a supervisor cut off from the stop finds it later); no running or relaunching
    write, however new, replaces it."""
    monkeypatch.setattr(files, "supervisors_root", lambda: str(tmp_path))
    job_id = "ab" * 8
    stopped = Supervision(SupervisorState.STOPPED, 1, 2, version=2)

    def put_(copy: Supervision, version: int, action: Literal["look", "end"] = "look") -> bool:
        request = SupervisorRequest(job_id, "", action, record=copy, version=version)
        nsup.supervisor(request)
        return nsup.supervisor(SupervisorRequest(job_id, "")).record == copy

    assert put_(record(7), 6)
    assert put_(stopped, 1, "end")  # read version 1; the copy is at 7: a stop lands anyway
    assert not put_(record(9), 8)  # a supervisor that counted on alone: the stop stays
    claim = Supervision(SupervisorState.RELAUNCHING, 2, 1, version=9, by=2)
    assert not put_(claim, 8)
    assert put_(Supervision(SupervisorState.STOPPED, 1, 2, version=3), 2)  # a stop again
    stored = files.read_text(files.supervision_copy(job_id))
    assert nsup.accepts(stored, stopped, 0)
    assert not nsup.accepts(stored, record(100), 100)
    assert nsup.accepts(None, record(1), 0)
    assert nsup.accepts("garbage", record(1), 0)  # an unreadable copy is version 0
