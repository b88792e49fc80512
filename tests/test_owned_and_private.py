"""The smaller items of issue 43's item 8, each a unit: ``job.json`` (which holds the config's
``env``, where tokens go) is written 0600; the job index is written below the hostfile's
directory without following a link; NVML and ``nvidia-smi`` are taken only from a file (and
directory) of this user's or root's that no one else can write, NVML by absolute path; a
supervisor's or keeper's pid file is believed only for a process of this user's."""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.fake_pool import HOSTS, FakePool, healthy

from meshkit.job import Job
from meshkit.node import files, gpu_readings, gpus, procs
from meshkit.node import supervise as nsup
from meshkit.node.sync import put
from meshkit.ops import jobs as ops
from meshkit.protocol import PutRequest, SupervisorRequest

NOBODY = 65534
as_root = pytest.mark.skipif(os.getuid() != 0, reason="another user's file or process needs root")


# ---- job.json and the index -------------------------------------------------------------------


def test_the_job_file_is_private_and_the_index_follows_no_link_below_the_hostfiles_directory():
    pool = FakePool(healthy())
    job = Job("train", "/w", "s", "/shared/hostfile", "/venv/bin/python", 25000)
    assert ops.launch(pool, job, HOSTS).ok
    assert pool.modes[(HOSTS[0], "/w/.meshkit/s/job.json")] == 0o600
    index = (HOSTS[0], "/shared/.meshkit/jobs/hostfile--s.json")
    assert pool.roots[index] == "/shared"


def test_the_index_is_not_written_through_a_link_planted_beside_the_hostfile(tmp_path: Path):
    """What the node does with the index's root: ``.meshkit`` beside the hostfile is a link to
    another user's directory, and nothing is written there."""
    project = tmp_path / "project"
    project.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (project / ".meshkit").symlink_to(elsewhere)
    index = f"{project}/.meshkit/jobs/hostfile--s.json"
    data = base64.b64encode(b'{"workdir": "/w"}').decode()
    with pytest.raises(ValueError, match="link"):
        put(PutRequest(index, data, 0, True, 0o644, time.time(), str(project)))
    assert list(elsewhere.iterdir()) == []
    (project / ".meshkit").unlink()
    put(PutRequest(index, data, 0, True, 0o644, time.time(), str(project)))
    assert Path(index).read_text() == '{"workdir": "/w"}'


# ---- the GPU driver's files -------------------------------------------------------------------


def smi_in(directory: Path) -> Path:
    directory.mkdir(exist_ok=True)
    smi = directory / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: A (UUID: x)'\n")
    smi.chmod(0o755)
    return smi


def test_nvidia_smi_on_path_is_taken_only_when_no_one_else_can_write_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    smi = smi_in(tmp_path / "bin")
    (tmp_path / "bin").chmod(0o755)
    assert gpus._on_path("nvidia-smi") == str(smi)
    smi.chmod(0o775)  # group-writable
    assert gpus._on_path("nvidia-smi") is None
    smi.chmod(0o755)
    (tmp_path / "bin").chmod(0o777)  # anyone could swap it
    assert gpus._on_path("nvidia-smi") is None


@as_root
def test_nvidia_smi_of_another_users_is_never_run(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    smi = smi_in(tmp_path / "bin")
    os.chown(smi, NOBODY, NOBODY)
    assert gpus._on_path("nvidia-smi") is None
    assert gpu_readings.read_smi() is None


def test_nvml_is_loaded_by_absolute_path_from_the_drivers_directories(tmp_path, monkeypatch):
    good = tmp_path / "lib"
    good.mkdir()
    library = good / gpu_readings.NVML_LIBRARY
    library.write_bytes(b"\x7fELF")
    shared = tmp_path / "shared"
    shared.mkdir()
    shutil.copy(library, shared / gpu_readings.NVML_LIBRARY)
    shared.chmod(0o777)
    # LD_LIBRARY_PATH is never searched: only the directories named
    monkeypatch.setenv("LD_LIBRARY_PATH", str(shared))
    monkeypatch.setattr(gpu_readings, "NVML_DIRECTORIES", (str(shared),))
    assert gpu_readings.nvml_path() is None  # a directory anyone can write in
    monkeypatch.setattr(gpu_readings, "NVML_DIRECTORIES", (str(shared), str(good)))
    assert gpu_readings.nvml_path() == str(library)
    link = tmp_path / "link"
    link.mkdir()
    (link / gpu_readings.NVML_LIBRARY).symlink_to(shared / gpu_readings.NVML_LIBRARY)
    monkeypatch.setattr(gpu_readings, "NVML_DIRECTORIES", (str(link),))
    assert gpu_readings.nvml_path() is None  # judged by where the link leads


# ---- pid files name processes of this user's --------------------------------------------------


def test_a_pid_file_holds_a_pid_linux_could_give():
    assert nsup.recorded_pid("12\n1.5\n") == 12
    for text in ("0\n", "-5\n", f"{1 << 40}\n", "9" * 5000):
        assert nsup.recorded_pid(text) is None


@pytest.fixture
def nobodys_supervisor() -> Iterator[subprocess.Popen[bytes]]:
    """A process of nobody's whose command line is that of the supervisor of ``s`` in
    ``/w``: what a reused pid may be."""
    python = shutil.which("python3", path="/usr/bin:/bin")
    assert python is not None
    argv = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", python]
    argv += ["-c", "import time; time.sleep(60)", "supervise", "--session", "s"]
    argv += ["--workdir", "/w"]
    proc = subprocess.Popen(argv)
    deadline = time.monotonic() + 10
    while procs.owner(proc.pid) != NOBODY and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_this_process_is_mine():
    assert procs.mine(os.getpid())
    assert procs.owner(os.getpid()) == os.getuid()


@as_root
def test_another_users_process_is_no_supervisor_and_no_keeper(
    tmp_path, monkeypatch, nobodys_supervisor
):
    monkeypatch.setattr(files, "supervisors_root", lambda: str(tmp_path))
    pid = nobodys_supervisor.pid
    assert procs.alive(pid)
    assert not procs.mine(pid)
    job_id = "ab" * 8
    Path(files.supervisor_pid_file(job_id)).write_text(f"{pid}\n")
    request = SupervisorRequest(job_id, "", session="s", workdir="/w")
    assert nsup.supervisor_pid(request) is None
    reply = nsup.supervisor(SupervisorRequest(job_id, "", "end", session="s", workdir="/w"))
    assert reply.pid is None
    assert nobodys_supervisor.poll() is None  # not signalled: not ours
    pid_file = tmp_path / "keeper.pid"
    pid_file.write_text(f"{pid}\n")
    assert procs.recorded(str(pid_file), "supervise") is None
