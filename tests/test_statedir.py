"""The node's state directory (/tmp/meshkit-UID) is this user's alone: one another user made
first, a symlink, or a subdirectory of another user's is refused on every node before anything
starts anywhere; the files in it are 0600 and its directories 0700, and no temporary file is
ever written through a link planted at its name."""

from __future__ import annotations

import base64
import os
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import meshkit
from helpers.sandbox_jobs import on_node

from meshkit import protocol, sandbox
from meshkit.node import diagnose as node_diagnose
from meshkit.node import files
from meshkit.node import jobs as node_jobs
from meshkit.node import supervise as node_supervise

SANDBOX_NODES = 3
JOB_ID = "ab" * 8
NOBODY = 65534


@pytest.fixture
def root(tmp_path, monkeypatch):
    """A state root of the test's own, in place of this machine's /tmp/meshkit-UID."""
    path = str(tmp_path / "meshkit-state")
    monkeypatch.setattr(files, "state_root", lambda: path)
    return Path(path)


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


# ---- on one machine: the checked directories and the files in them


def test_the_state_directories_and_files_are_this_users_alone(root):
    directory = files.private_dir(files.job_dir(JOB_ID))
    spec = Path(files.spec_file(directory))
    old_umask = os.umask(0)  # the modes are the node's own, whatever umask it was started with
    try:
        files.write_atomic(spec, "{}")
    finally:
        os.umask(old_umask)
    assert mode_of(root) == 0o700
    assert mode_of(root / "jobs") == 0o700
    assert mode_of(Path(directory)) == 0o700
    assert mode_of(spec) == 0o600
    assert os.listdir(directory) == [files.SPEC]  # no temporary left
    record = protocol.Supervision(protocol.SupervisorState.RUNNING, 1, 2, version=1)
    node_supervise.supervisor(protocol.SupervisorRequest(JOB_ID, "", record=record))
    supervisors = root / "supervisors"
    assert mode_of(supervisors) == 0o700
    modes = {path.name: mode_of(path) for path in supervisors.iterdir()}
    assert modes == {f"{JOB_ID}.json": 0o600, f"{JOB_ID}.json.lock": 0o600}


def test_write_atomic_never_follows_a_link_at_its_temporary_name(tmp_path, monkeypatch):
    victim = tmp_path / "victim"
    victim.write_text("keep me\n")
    target = tmp_path / "out.json"
    planted = tmp_path / f".out.json.{os.getpid()}"  # the name today's main writes through
    planted.symlink_to(victim)
    files.write_atomic(target, "new\n")
    assert victim.read_text() == "keep me\n"
    assert target.read_text() == "new\n"
    # even a link at the very name it picks is refused, not followed
    monkeypatch.setattr(files, "temporary_name", lambda path: str(planted))
    with pytest.raises(FileExistsError):
        files.write_atomic(target, "through the link\n")
    assert victim.read_text() == "keep me\n"
    assert planted.is_symlink()


def test_a_directory_with_group_or_other_bits_only_readable_is_tightened(root):
    root.mkdir(mode=0o755)
    os.chmod(root, 0o755)  # what an older meshkit left: this user's, nobody else could write
    files.check_state()
    assert mode_of(root) == 0o700


@pytest.mark.parametrize("planted", ["other user", "writable", "symlink"])
def test_every_op_refuses_a_state_directory_another_user_could_write(root, tmp_path, planted):
    """start, status, stop, the preflight's jobs and ports, supervisor and diagnose: each refuses
    and names the path, what was found and the fix; start writes nothing."""
    jobs = root / "jobs"
    root.mkdir(mode=0o700)
    if planted == "symlink":
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir(mode=0o700)
        jobs.symlink_to(elsewhere)
        found = "a symlink"
    else:
        jobs.mkdir(mode=0o700)
        if planted == "writable":
            os.chmod(jobs, 0o777)
            found = "mode 0777, writable by others"
        else:
            if os.geteuid() != 0:
                pytest.skip("giving a directory to another user needs root")
            os.chown(jobs, NOBODY, NOBODY)
            found = f"owned by uid {NOBODY}, not by this user"
    job = protocol.NodeJob(JOB_ID, "s", "s in x", str(tmp_path), "s-x", ["true"])
    calls = [
        lambda: node_jobs.jobs(protocol.JobsRequest()),
        lambda: node_jobs.start(protocol.StartRequest(job)),
        lambda: node_jobs.status(protocol.StatusRequest(JOB_ID, str(tmp_path / "log"))),
        lambda: node_jobs.stop(protocol.StopRequest(JOB_ID)),
        lambda: node_diagnose.diagnose(protocol.DiagnoseRequest(JOB_ID, "", str(tmp_path))),
    ]
    for call in calls:
        with pytest.raises(files.UnsafeStateDir) as refused:
            call()
        message = str(refused.value)
        assert f"{jobs} is {found}" in message
        assert files.NEVER in message
    assert not list(tmp_path.rglob(files.SPEC))
    # the supervisors' directory, planted the same way
    supervisors = root / "supervisors"
    supervisors.symlink_to(tmp_path)
    with pytest.raises(files.UnsafeStateDir, match="a symlink"):
        node_supervise.supervisor(protocol.SupervisorRequest(JOB_ID, ""))
    with pytest.raises(files.UnsafeStateDir, match="a symlink"):
        node_supervise.register(JOB_ID)


def test_the_keeper_runs_nothing_from_a_directory_another_user_could_write(tmp_path):
    directory = tmp_path / "job"
    directory.mkdir(mode=0o700)
    os.chmod(directory, 0o777)
    (directory / files.SPEC).write_text("{}")
    keep = [sys.executable, "-m", "meshkit.node", "keep", str(directory)]
    done = subprocess.run(keep, capture_output=True, text=True, timeout=30)
    assert done.returncode == 2
    assert f"{directory} is mode 0777, writable by others" in done.stderr
    assert sorted(os.listdir(directory)) == [files.SPEC]  # no error or exit file written in it


# ---- on the sandbox: another local user got there first


@pytest.fixture(scope="module")
def meshed(cluster):
    out = meshkit("mesh", "--hostfile", str(cluster.hostfile), "--no-verify")
    assert out.returncode == 0, out.stdout + out.stderr
    workdir = cluster.shared / "statedir"
    workdir.mkdir()
    return cluster, workdir


def as_nobody(*argv: str) -> list[str]:
    return ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *argv]


def plant(node: sandbox.Node, how: str) -> str:
    """Make node's /tmp/meshkit-0 unsafe, as ``how`` says; returns what the refusal finds."""
    commands = {
        # another user creates the root before the job's user ever ran meshkit there
        "root taken": [as_nobody("mkdir", "-m", "0777", "/tmp/meshkit-0")],
        "root a symlink": [
            ["mkdir", "-m", "0700", "/tmp/elsewhere"],
            ["ln", "-s", "/tmp/elsewhere", "/tmp/meshkit-0"],
        ],
        "jobs taken": [
            ["mkdir", "-m", "0700", "/tmp/meshkit-0", "/tmp/meshkit-0/jobs"],
            ["chown", f"{NOBODY}:{NOBODY}", "/tmp/meshkit-0/jobs"],
        ],
    }
    for argv in commands[how]:
        done = sandbox.node_exec(node, argv)
        assert done.returncode == 0, done.stderr
    found = {
        "root taken": f"/tmp/meshkit-0 is owned by uid {NOBODY}, not by this user (uid 0)",
        "root a symlink": "/tmp/meshkit-0 is a symlink",
        "jobs taken": f"/tmp/meshkit-0/jobs is owned by uid {NOBODY}, not by this user (uid 0)",
    }
    return found[how]


FIXES = {
    "root taken": "it is not yours: ask its owner or the admin to remove it",
    "root a symlink": "remove it (rm -rf /tmp/meshkit-0) and run meshkit again",
    "jobs taken": "it is not yours: ask its owner or the admin to remove it",
}


def clean(lay: sandbox.Layout) -> None:
    for node in lay.nodes:
        sandbox.node_exec(node, ["rm", "-rf", "/tmp/meshkit-0", "/tmp/elsewhere"])


@pytest.mark.parametrize("how", ["root taken", "root a symlink", "jobs taken"])
def test_train_refuses_a_node_whose_state_directory_another_user_could_write(meshed, how):
    lay, workdir = meshed
    clean(lay)
    victim = lay.nodes[1]
    found = plant(victim, how)
    session = how.replace(" ", "-")
    out = on_node(
        lay, 0, workdir, "train", "--hostfile", str(lay.hostfile), "--session", session,
        "--cmd", "sleep 600",
    )  # fmt: skip
    text = out.stdout + out.stderr
    assert out.returncode != 0, text
    refusal = [line for line in text.splitlines() if found in line]
    assert refusal, text
    assert victim.address in refusal[0] or victim.name in refusal[0], text
    assert FIXES[how] in refusal[0], text
    assert files.NEVER in refusal[0], text
    assert "Traceback" not in text
    for node in lay.nodes:
        sessions = sandbox.node_exec(node, ["tmux", "list-sessions", "-F", "#S"])
        assert session not in sessions.stdout, node.name
        specs = sandbox.node_exec(node, ["find", "-L", "/tmp", "-name", files.SPEC])
        assert specs.stdout.strip() == "", (node.name, specs.stdout)
    assert not (workdir / ".meshkit" / session).exists()  # not even the controller's record
    clean(lay)


def test_sync_put_never_writes_through_a_link_at_a_temporary_name(tmp_path):
    """A chunked put: its temporary is new, and named so nobody can plant a link there first."""
    from meshkit.node.sync import put

    victim = tmp_path / "victim"
    victim.write_text("keep me\n")
    target = tmp_path / "work" / "model.py"
    target.parent.mkdir()
    planted = target.with_name(f".{target.name}.meshkit-{os.getpid()}")  # today's main's name
    planted.symlink_to(victim)
    for offset, chunk, last in ((0, b"first ", False), (6, b"second\n", True)):
        encoded = base64.b64encode(chunk).decode()
        put(protocol.PutRequest(str(target), encoded, offset, last, 0o644, 1234.5))
    assert victim.read_text() == "keep me\n"
    assert target.read_text() == "first second\n"
    assert sorted(os.listdir(target.parent)) == [planted.name, target.name]  # no temporary left


def test_the_rank_hooks_error_file_is_the_users_alone(tmp_path):
    """The hook's own files are 0600 whatever the rank's umask (the hook sets none: it runs in the
    user's ranks, whose own files keep the modes the user's umask gives them)."""
    errors = tmp_path / "errors"
    hook = Path(files.__file__).parent / "hook"
    env = {**os.environ, "PYTHONPATH": str(hook), "RANK": "3", "MESHKIT_ERRORS": str(errors)}
    code = "open('mine', 'w').close(); raise ValueError('boom')"
    done = subprocess.run(
        ["sh", "-c", f"umask 022; exec {sys.executable} -c {shlex.quote(code)}"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert "ValueError: boom" in done.stderr
    assert mode_of(Path(files.rank_error_file(str(errors), 3))) == 0o600
    assert mode_of(tmp_path / "mine") == 0o644  # the user's own file: the user's umask
