"""On this machine, no nodes: the copy plan (pure) and the node side's manifest and put.

The manifest of a workdir comes in pages, and the chunked put never writes through a link. train
--sync on sandbox nodes is test_sync, with large workdirs test_sync_scale."""

from __future__ import annotations

import base64
import os
import time
from dataclasses import replace

import pytest

from meshkit.node.agent import handler
from meshkit.node.sync import MAX_FILES, manifest, put, put_files
from meshkit.ops.sync import Manifest, Sender, local_files, plan
from meshkit.protocol import (
    MAX_LINE,
    PUT_CHUNK,
    Blocker,
    FileState,
    ManifestRequest,
    PutFilesRequest,
    PutRequest,
    Supervision,
    SupervisorRequest,
    SupervisorState,
    WholeFile,
    decode_request,
    encode_reply,
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
    (tmp_path / "data").symlink_to("/nowhere/dataset", target_is_directory=True)
    os.mkfifo(tmp_path / "a" / "pipe")
    reply = manifest(ManifestRequest(str(tmp_path), [".git", "__pycache__"]))
    assert reply.exists
    assert not reply.more
    assert [(listed.path, listed.size) for listed in reply.files] == [("a/b.py", 9)]
    assert reply.blockers == [  # a directory's own entries, then those of its directories
        Blocker("data", "a symlink to /nowhere/dataset"),
        Blocker("link", f"a symlink to {tmp_path / 'a' / 'b.py'}"),
        Blocker("a/pipe", "a FIFO"),
    ]
    assert not manifest(ManifestRequest(str(tmp_path / "nope"))).exists


def test_a_manifest_of_100000_files_comes_in_pages_each_under_the_line_limit(tmp_path):
    """The node's side of the paging (a sandbox sync of this many files would take minutes):
    every file listed once, every page a line the protocol sends."""
    started = time.monotonic()
    for directory in range(100):
        (tmp_path / f"d{directory:03}").mkdir()
        for number in range(MAX_FILES // 100):
            # Long names: fewer files than that already overflowed one line.
            name = f"d{directory:03}/checkpoint-shard-{number:05}-of-01000.safetensors"
            os.close(os.open(tmp_path / name, os.O_CREAT | os.O_WRONLY))
    listed = []
    page = 0
    while True:
        reply = manifest(ManifestRequest(str(tmp_path), [], page))
        assert len(encode_reply(reply).encode()) <= MAX_LINE
        listed += [state.path for state in reply.files]
        page += 1
        if not reply.more:
            break
    assert page > 10
    assert len(listed) == len(set(listed)) == MAX_FILES
    assert listed[-1] == "d099/checkpoint-shard-00999-of-01000.safetensors"
    with pytest.raises(ValueError, match="before its first page"):
        manifest(ManifestRequest(str(tmp_path), [], 1))  # the listing ended with its last page
    print(f"100,000-file manifest: {time.monotonic() - started:.1f}s")


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


def chunks_of(root: str, path: str, data: bytes) -> list[PutRequest]:
    """``data`` as put requests of 1000 bytes for ``path`` below the workdir ``root``."""
    requests = []
    for offset in range(0, len(data), 1000):
        encoded = base64.b64encode(data[offset : offset + 1000]).decode()
        last = offset + 1000 >= len(data)
        requests.append(PutRequest(path, encoded, offset, last, 0o644, 1.0, root))
    return requests


def test_put_never_writes_through_a_link_below_the_workdir(tmp_path):
    dataset = tmp_path / "nvme" / "dataset"
    dataset.mkdir(parents=True)
    (dataset / "train.bin").write_bytes(b"the node's own dataset")
    (tmp_path / "outside").write_text("not the workdir's\n")
    work = tmp_path / "work"
    work.mkdir()
    (work / "data").symlink_to(dataset)
    (work / "weights.bin").symlink_to(tmp_path / "outside")
    os.mkfifo(work / "pipe")
    root = str(work)
    for path, what in (
        ("data/train.bin", f"{work}/data is a symlink to {dataset}"),
        ("data/new/x.py", f"{work}/data is a symlink to {dataset}"),
        ("weights.bin", f"{work}/weights.bin is a symlink to {tmp_path / 'outside'}"),
        ("pipe", f"{work}/pipe is a FIFO"),
    ):
        first = chunks_of(root, f"{root}/{path}", b"controller copy " * 100)[0]
        with pytest.raises(ValueError, match=f"^{what} on the node; .*exclude it"):
            put(first)
    assert (dataset / "train.bin").read_bytes() == b"the node's own dataset"
    assert sorted(os.listdir(dataset)) == ["train.bin"]
    assert (tmp_path / "outside").read_text() == "not the workdir's\n"
    assert sorted(os.listdir(work)) == ["data", "pipe", "weights.bin"]  # no temporary left
    # A link swapped in for a directory between two chunks is not followed: the open directory
    # is written.
    (work / "real").mkdir()
    requests = chunks_of(root, f"{root}/real/f.bin", os.urandom(3000))
    put(requests[0])
    (work / "real").rename(work / "moved")
    (work / "real").symlink_to(dataset)
    for request in requests[1:]:
        put(request)
    assert sorted(os.listdir(dataset)) == ["train.bin"]
    assert (work / "moved" / "f.bin").stat().st_size == 3000
    # The workdir itself may be a link: its real path is where the files go.
    (tmp_path / "linked").symlink_to(work / "moved")
    for request in chunks_of(str(tmp_path / "linked"), f"{tmp_path}/linked/sub/g.py", b"g"):
        put(request)
    assert (work / "moved" / "sub" / "g.py").read_bytes() == b"g"
    with pytest.raises(ValueError, match="not a file path below"):
        put(PutRequest(f"{root}/x", "", 0, True, 0o644, 1.0, "/elsewhere"))


def test_a_sender_sends_small_files_together_and_a_large_one_a_chunk_at_a_time(tmp_path):
    """What the controller sends one node, applied by the node's handlers: every line within
    the protocol's limit, many small files per round trip, a large file streamed with at most
    a few chunks in memory (tracemalloc's peak, far below the file's size)."""
    import tracemalloc

    here = tmp_path / "here"
    (here / "src").mkdir(parents=True)
    for number in range(1000):
        (here / "src" / f"m{number:04}.py").write_text(f"x = {number}\n")
    (here / "src" / "mid.bin").write_bytes(os.urandom(PUT_CHUNK - 10))
    big = here / "model.pt"
    with open(big, "wb") as out:  # sparse: 16 MiB on disk in a moment
        out.write(b"head")
        out.seek(16 << 20)
        out.write(b"tail")
    there = tmp_path / "there"

    def elsewhere(path: str) -> str:
        return path.replace(str(here), str(there), 1)

    files = local_files(str(here), [])
    sender = Sender(str(here), files)
    requests = 0
    tracemalloc.start()
    while sender.has_more():
        request = sender.next_request()
        assert len(encode_request(request).encode()) <= MAX_LINE
        # the node's root is elsewhere here: the same relative paths below it
        if isinstance(request, PutFilesRequest):
            moved = [replace(small, path=elsewhere(small.path)) for small in request.files]
            put_files(PutFilesRequest(str(there), moved))
        else:
            put(replace(request, path=elsewhere(request.path), root=str(there)))
        requests += 1
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 8 * PUT_CHUNK, peak  # the file is 32 chunks
    assert sender.sent == len(files) == 1002
    assert requests < 1000 // 100 + (16 << 20) // PUT_CHUNK + 4  # small files: hundreds at once
    assert (there / "model.pt").read_bytes() == big.read_bytes()
    assert (there / "model.pt").stat().st_blocks * 512 < 2 * PUT_CHUNK  # its zeros left holes
    assert (there / "src" / "mid.bin").read_bytes() == (here / "src" / "mid.bin").read_bytes()
    assert (there / "src" / "m0999.py").read_text() == "x = 999\n"
    assert (there / "src" / "m0999.py").stat().st_mtime == (
        here / "src" / "m0999.py"
    ).stat().st_mtime


def test_new_ops_round_trip_and_have_handlers():
    for request in (
        SupervisorRequest("ab" * 8, "s-abababab-sup", "start", ["x"], record(3), 3),
        ManifestRequest("/w", [".git"], 3),
        PutRequest("/w/x", "AA==", 0, True, 0o600, 1.0, "/w"),
        PutFilesRequest("/w", [WholeFile("/w/y", "AA==", 0o644, 2.0)]),
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
    chosen = plan(local, Manifest(True, remote))
    assert [state.path for state in chosen.send] == ["b.py", "c.py"]
    assert chosen.blocked == []


def test_sync_plan_sends_nothing_through_or_over_what_is_in_the_way_on_the_node():
    local = [
        FileState("code.py", 1, 1.0, 0o644),
        FileState("data/a/1.bin", 1, 1.0, 0o644),
        FileState("data/b/2.bin", 1, 1.0, 0o644),
        FileState("logs/x", 1, 1.0, 0o644),
        FileState("out", 1, 1.0, 0o644),
        FileState("pipe", 1, 1.0, 0o644),
    ]
    link = Blocker("data", "a symlink to /nvme/dataset")
    fifo = Blocker("pipe", "a FIFO")
    remote = [FileState("logs", 5, 1.0, 0o644), FileState("out/kept.txt", 1, 1.0, 0o644)]
    chosen = plan(local, Manifest(True, remote, [link, fifo]))
    assert [state.path for state in chosen.send] == ["code.py"]
    assert chosen.blocked == [
        link,  # once, for both files below it
        Blocker("logs", "a file"),
        Blocker("out", "a directory"),
        fifo,
    ]
