"""Sandbox, at size: train --sync with 20,000 files and a 1 GiB file, on two nodes.

The nodes each have their own /tmp: 20,000 files (listed by the node in pages, also when a
supervisor relaunches the job and syncs again) and a 1 GiB file (sent a chunk at a time: the
controller's memory stays far below the file's size). Apart from test_sync because it needs a
sandbox of another size and takes minutes (CI's workers share out whole modules); the copy plan
and the node side alone are test_sync_node."""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import sys
from pathlib import Path

import pytest
from conftest import meshkit
from helpers.sandbox_jobs import on_node, private, wait_for

from meshkit import sandbox

SANDBOX_NODES = 2
HOSTFILE = Path("/tmp/mkhosts/hostfile")
FILES = 20000
GIB = 1 << 30
MEMORY_BOUND = 200 << 20  # bytes: the controller's peak resident memory, far below the file


@pytest.fixture(scope="module")
def meshed(cluster):
    out = meshkit("mesh", "--hostfile", str(cluster.hostfile), "--no-verify")
    assert out.returncode == 0, out.stdout + out.stderr
    hostfile = private(cluster, 0, HOSTFILE)
    hostfile.parent.mkdir(parents=True)
    hostfile.write_text(cluster.hostfile.read_text())
    return cluster


def run_in(lay, index: int, *args: str):
    out = on_node(lay, index, Path("/"), *args)
    assert out.returncode == 0, out.stdout + out.stderr
    return out


def test_20000_files_are_synced_and_a_supervised_relaunch_syncs_them_again(meshed):
    lay = meshed
    work = Path("/tmp/mkwork-many")
    here = private(lay, 0, work)
    for directory in range(20):
        (here / f"part{directory:02}").mkdir(parents=True)
        for number in range(FILES // 20):
            path = here / f"part{directory:02}" / f"sample-{number:05}-of-20000.json"
            # Mostly empty: 20,000 files of data would be slow to delete on this disk.
            with open(path, "w") as sample:
                if number % 100 == 99:
                    sample.write(f"{directory} {number}\n")
    # The first attempt fails on every node: the supervisor relaunches the job, syncing first
    # (each node's listing of 20,000 files no longer fits one protocol line).
    (here / "job.sh").write_text("test -e second && exit 0\ntouch second\nexit 3\n")
    base = ["--workdir", str(work), "--session", "many"]
    out = run_in(
        lay,
        0,
        "train",
        "--hostfile",
        str(HOSTFILE),
        *base,
        "--restarts",
        "1",
        "--cmd",
        "bash job.sh",
    )
    assert f"synced {FILES + 1} changed files to {lay.nodes[1].address}" in out.stdout, out.stdout
    copy = private(lay, 1, work)
    assert (copy / "part19" / "sample-00999-of-20000.json").read_text() == "19 999\n"
    assert sum(1 for _ in copy.rglob("sample-*")) == FILES

    def supervisor_ended() -> bool:
        """Whether a node's supervisor logged its end (in its own copy of the workdir): only
        then is status asked, a round of which costs about a second of CPU."""
        for index in range(lay.count):
            home = private(lay, index, work) / ".meshkit" / "many"
            for log in home.glob("supervisor-node*.log"):
                text = log.read_text()
                if " done: " in text or " gave up: " in text:
                    return True
        return False

    def finished() -> list | None:
        if not supervisor_ended():
            return None
        rows = json.loads(run_in(lay, 1, "status", *base, "--json").stdout)
        if rows[0]["supervisor"] == "done":
            return rows
        assert rows[0]["supervisor"] != "gave up", rows
        return None

    rows = wait_for(finished, timeout=180)
    assert rows[0]["attempt"] == 2, rows
    assert rows[0]["last_restart_reason"], rows
    run_in(lay, 0, "stop", *base)


def test_a_1gib_file_is_synced_with_the_controllers_memory_far_below_its_size(meshed):
    lay = meshed
    work = Path("/tmp/mkwork-big")
    here = private(lay, 0, work)
    here.mkdir(parents=True)
    big = here / "checkpoint.pt"
    with open(big, "wb") as out:  # sparse, with data at both ends and in the middle
        for offset in (0, GIB // 2 + 12345, GIB - 4096):
            out.seek(offset)
            out.write(os.urandom(4096))
    (here / "job.sh").write_text("sleep 120\n")
    base = ["--workdir", str(work), "--session", "big"]
    line = ["train", "--hostfile", str(HOSTFILE), *base, "--cmd", "bash job.sh"]
    # The controller's peak resident memory: the largest child's, as its parent sees it.
    measure = (
        "import resource, subprocess, sys;"
        "code = subprocess.call(sys.argv[1:]);"
        "print('maxrss', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss);"
        "sys.exit(code)"
    )
    command = shlex.join([sys.executable, "-c", measure, sys.executable, "-m", "meshkit", *line])
    out = sandbox.node_exec(lay.nodes[0], ["bash", "-c", command], timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"synced 2 changed files to {lay.nodes[1].address}" in out.stdout, out.stdout
    peak = int(out.stdout.rsplit("maxrss ", 1)[1].split()[0]) * 1024  # Linux: KiB
    assert peak < MEMORY_BOUND, f"the controller's peak memory: {peak >> 20} MiB"
    copy = private(lay, 1, work) / "checkpoint.pt"
    assert copy.stat().st_size == GIB

    def digest(path: Path) -> str:
        with open(path, "rb") as file:
            return hashlib.file_digest(file, "sha256").hexdigest()

    assert digest(copy) == digest(big)
    run_in(lay, 0, "stop", *base)
