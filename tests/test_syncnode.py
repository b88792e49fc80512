"""Sync (the copy plan, and the node side: manifest, chunked put) and the node side of
supervision (ending a supervisor, the record's compare-and-set), on this machine."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshkit.node import supervise as nsup
from meshkit.node.agent import handler
from meshkit.node.sync import manifest, put
from meshkit.ops.sync import plan
from meshkit.protocol import (
    FileState,
    ManifestRequest,
    PutRequest,
    Supervision,
    SupervisorRequest,
    SupervisorState,
    decode_request,
    encode_request,
)


def record(version: int, by: int = 0) -> Supervision:
    """A supervision record at ``version``, written by rank ``by``."""
    return Supervision(SupervisorState.RUNNING, 1, 2, version=version, by=by)


def test_manifest_lists_files_and_skips_excluded_names(tmp_path):
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "HEAD").write_text("x")
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "b.py").write_text("print(1)\n")
    (tmp_path / "a" / "__pycache__").mkdir()
    (tmp_path / "a" / "__pycache__" / "b.pyc").write_bytes(b"x")
    (tmp_path / "link").symlink_to(tmp_path / "a" / "b.py")
    reply = manifest(ManifestRequest(str(tmp_path), [".git", "__pycache__"]))
    assert reply.exists and [(f.path, f.size) for f in reply.files] == [("a/b.py", 9)]
    assert not manifest(ManifestRequest(str(tmp_path / "nope"))).exists


def test_put_writes_chunks_then_moves_the_file_into_place_with_mode_and_mtime(tmp_path):
    target = tmp_path / "d" / "f.bin"
    data = os.urandom(3000)

    def chunk(i: int, last: bool) -> PutRequest:
        part = data[i * 1000 : (i + 1) * 1000]
        return PutRequest(
            str(target), base64.b64encode(part).decode(), i * 1000, last, 0o750, 1234.5
        )

    for i in range(3):
        assert put(chunk(i, i == 2)).written == 1000
        assert target.exists() == (i == 2)  # never a half-written file under its name
    assert target.read_bytes() == data
    assert target.stat().st_mtime == 1234.5 and target.stat().st_mode & 0o777 == 0o750
    with pytest.raises(ValueError, match="absolute path"):
        put(PutRequest("rel/x", "", 0, True))
    with pytest.raises(ValueError, match="absolute path"):
        put(PutRequest(str(tmp_path / ".." / "x"), "", 0, True))


def test_new_ops_round_trip_and_have_handlers():
    for request in (
        SupervisorRequest("ab" * 8, "s-abababab-sup", "start", ["x"], record(3), 3),
        ManifestRequest("/w", [".git"]),
        PutRequest("/w/x", "AA==", 0, True, 0o600, 1.0),
    ):
        op, back = decode_request(encode_request(request))
        assert back == request and callable(handler(op))


def test_end_stops_only_the_registered_supervisor_and_drops_the_copy(tmp_path, monkeypatch):
    monkeypatch.setattr(nsup, "supervisors_root", lambda: str(tmp_path))
    job_id = "cd" * 8
    nsup.supervisor(SupervisorRequest(job_id, "", record=record(1), version=0))
    # a stand-in supervisor: its command line says "supervise", as the real one's does
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "supervise"])
    try:
        Path(nsup.pid_file(job_id)).write_text(f"{proc.pid}\n")
        look = nsup.supervisor(SupervisorRequest(job_id, ""))
        assert look.pid == proc.pid and look.beat is not None and look.beat < 60
        reply = nsup.supervisor(SupervisorRequest(job_id, "", "end"))
        assert reply.pid == proc.pid and reply.left == []
        assert proc.wait(10) is not None and not Path(nsup.pid_file(job_id)).exists()
        again = nsup.supervisor(SupervisorRequest(job_id, ""))
        assert again.pid is None and again.record is None  # the copy went with it
    finally:
        proc.kill()
        proc.wait()


def test_the_record_copy_is_compare_and_set_on_its_version(tmp_path, monkeypatch):
    """Two writers that read version 1 both ask to write version 2: only the first wins; a copy
    that is missing or unreadable (a rebooted node) takes any write."""
    monkeypatch.setattr(nsup, "supervisors_root", lambda: str(tmp_path))
    job_id = "ef" * 8

    def put_(copy: Supervision, version: int) -> bool:
        return nsup.supervisor(SupervisorRequest(job_id, "", record=copy, version=version)).written

    assert put_(record(1, by=0), 0)
    assert put_(record(2, by=1), 1)
    assert not put_(record(2, by=2), 1)
    assert nsup.supervisor(SupervisorRequest(job_id, "")).record == record(2, by=1)
    assert nsup.version_of("not json") == 0 and nsup.version_of(None) == 0
    Path(nsup.pid_file(job_id, "json")).write_text("garbage")
    assert put_(record(3), 0)
    with pytest.raises(ValueError, match="bad job id"):
        nsup.supervisor(SupervisorRequest("../x", ""))


def test_sync_plan_sends_only_what_differs():
    local = [
        FileState("a.py", 3, 10.0, 0o644),
        FileState("b.py", 4, 10.0, 0o644),
        FileState("c.py", 5, 10.0, 0o644),
    ]
    remote = [
        FileState("a.py", 3, 10.0, 0o644),
        FileState("b.py", 4, 11.0, 0o644),
        FileState("old.py", 1, 1.0, 0o644),
    ]
    assert [state.path for state in plan(local, remote)] == ["b.py", "c.py"]
