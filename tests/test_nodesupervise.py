"""The node side of supervision, on this machine: ending a job's supervisor here and this node's
copy of the supervision record, written only by compare-and-set."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from meshkit.node import files
from meshkit.node import supervise as nsup
from meshkit.protocol import Supervision, SupervisorRequest, SupervisorState


def record(version: int, by: int = 0) -> Supervision:
    """A supervision record at ``version``, written by rank ``by``."""
    return Supervision(SupervisorState.RUNNING, 1, 2, version=version, by=by)


def test_end_stops_only_the_registered_supervisor_and_drops_the_copy(tmp_path, monkeypatch):
    monkeypatch.setattr(files, "supervisors_root", lambda: str(tmp_path))
    job_id = "cd" * 8
    nsup.supervisor(SupervisorRequest(job_id, "", record=record(1), version=0))
    # a stand-in supervisor: its command line says "supervise", as the real one's does
    stand_in = [sys.executable, "-c", "import time; time.sleep(60)", "supervise"]
    proc = subprocess.Popen(stand_in)
    try:
        Path(files.supervisor_pid_file(job_id)).write_text(f"{proc.pid}\n")
        look = nsup.supervisor(SupervisorRequest(job_id, ""))
        assert look.pid == proc.pid
        assert look.beat is not None
        assert look.beat < 60
        reply = nsup.supervisor(SupervisorRequest(job_id, "", "end"))
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
    assert nsup.version_of("not json") == 0
    assert nsup.version_of(None) == 0
    Path(files.supervision_copy(job_id)).write_text("garbage")
    assert put_(record(3), 0)
    with pytest.raises(ValueError, match="bad job id"):
        nsup.supervisor(SupervisorRequest("../x", ""))
