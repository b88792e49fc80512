"""Sync on this machine: the copy plan, and the node side (the manifest of a workdir and the
chunked put)."""

from __future__ import annotations

import base64
import os

import pytest

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
    assert reply.exists
    assert [(listed.path, listed.size) for listed in reply.files] == [("a/b.py", 9)]
    assert not manifest(ManifestRequest(str(tmp_path / "nope"))).exists


def test_put_writes_chunks_then_moves_the_file_into_place_with_mode_and_mtime(tmp_path):
    target = tmp_path / "d" / "f.bin"
    data = os.urandom(3000)

    def chunk(i: int, last: bool) -> PutRequest:
        part = data[i * 1000 : (i + 1) * 1000]
        encoded = base64.b64encode(part).decode()
        return PutRequest(str(target), encoded, i * 1000, last, 0o750, 1234.5)

    for i in range(3):
        assert put(chunk(i, i == 2)).written == 1000
        assert target.exists() == (i == 2)  # never a half-written file under its name
    assert target.read_bytes() == data
    assert target.stat().st_mtime == 1234.5
    assert target.stat().st_mode & 0o777 == 0o750
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
        assert back == request
        assert callable(handler(op))


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
