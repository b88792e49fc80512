"""Configuration trusted as OpenSSH trusts ~/.ssh/config (issue 43, item 7): an ssh_config
beside the hostfile, a meshkit.yaml, and (as root) the hostfile itself are obeyed only when
owned by this user or root and not writable by group or others. A planted one runs nothing:
the command exits non-zero naming the path and the fix, with no traceback.

No sandbox: the refusal comes before any connection, and the control case (a trusted file is
obeyed) needs no sshd either (``Match exec`` runs when the host is looked up). Planting a file
of another user needs root (chown); the non-root case runs meshkit as ``nobody``."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.other_user import as_user, login_env, readable_python

from meshkit import settings, trust
from meshkit.discovery import read_hosts
from meshkit.errors import UntrustedFileError
from meshkit.remote.connection import ssh_config

NOBODY = 65534
ANOTHER = 65533  # a uid no account needs: chown takes the number
as_root = pytest.mark.skipif(os.getuid() != 0, reason="planting another user's file needs root")


def meshkit(*argv: str, cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "meshkit", *argv],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def planted_ssh_config(directory: Path, marker: Path) -> Path:
    """An ssh_config whose every lookup would run a command that makes ``marker``."""
    path = directory / "ssh_config"
    path.write_text(
        f'Match exec "touch {marker}"\n  User x\nHost *\n  ProxyCommand touch {marker}\n'
    )
    return path


def refused(result: subprocess.CompletedProcess[str], path: Path, fix: str) -> None:
    """Exit non-zero, the path and the fix named, no traceback."""
    assert result.returncode == 2, result
    assert str(path.name) in result.stderr, result.stderr
    assert fix in result.stderr, result.stderr
    assert "Traceback" not in result.stderr + result.stdout


@pytest.fixture
def project(tmp_path: Path) -> Iterator[Path]:
    """A directory with a hostfile naming a node nothing answers on (port 1)."""
    (tmp_path / "hostfile").write_text("127.0.0.1:1\n")
    yield tmp_path


# ---- the one check --------------------------------------------------------------------------


def test_a_file_of_this_users_that_no_one_else_can_write_is_read(tmp_path: Path) -> None:
    path = tmp_path / "conf"
    path.write_bytes(b"hostfile: x\n")
    path.chmod(0o644)
    assert trust.read_trusted(str(path), 100, "configuration file") == b"hostfile: x\n"
    assert trust.read_trusted(str(tmp_path / "absent"), 100, "configuration file") is None


@pytest.mark.parametrize("mode", [0o664, 0o646, 0o666, 0o622])
def test_a_file_group_or_others_can_write_is_refused_with_chmod(tmp_path: Path, mode: int) -> None:
    path = tmp_path / "conf"
    path.write_text("hostfile: x\n")
    path.chmod(mode)
    with pytest.raises(UntrustedFileError) as caught:
        trust.read_trusted(str(path), 100, "configuration file")
    message = str(caught.value)
    assert str(path) in message
    assert f"mode {mode:04o}" in message
    assert f"chmod go-w {path}" in message


@as_root
def test_a_file_another_user_owns_is_refused_even_read_only(tmp_path: Path) -> None:
    path = tmp_path / "conf"
    path.write_text("hostfile: x\n")
    path.chmod(0o444)
    os.chown(path, NOBODY, NOBODY)
    with pytest.raises(UntrustedFileError, match=f"owned by uid {NOBODY}") as caught:
        trust.read_trusted(str(path), 100, "configuration file")
    assert f"chown {os.getuid()} {path}" in str(caught.value)


@as_root
def test_a_link_is_judged_by_the_file_it_leads_to(tmp_path: Path) -> None:
    target = tmp_path / "theirs"
    target.write_text("hostfile: x\n")
    os.chown(target, NOBODY, NOBODY)
    link = tmp_path / "conf"
    link.symlink_to(target)
    with pytest.raises(UntrustedFileError, match="owned by uid"):
        trust.read_trusted(str(link), 100, "configuration file")
    os.chown(target, 0, 0)
    assert trust.read_trusted(str(link), 100, "configuration file") == b"hostfile: x\n"


def test_a_fifo_planted_at_the_name_is_refused_without_blocking(tmp_path: Path) -> None:
    path = tmp_path / "conf"
    os.mkfifo(path, 0o600)
    with pytest.raises(UntrustedFileError, match="not a regular file"):
        trust.read_trusted(str(path), 100, "configuration file")


def test_more_than_the_limit_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "conf"
    path.write_bytes(b"x" * 101)
    with pytest.raises(UntrustedFileError, match="larger than 100 bytes"):
        trust.read_trusted(str(path), 100, "configuration file")


def test_the_rule_is_opensshs_owner_this_user_or_root_no_group_or_other_write() -> None:
    def status(uid: int, mode: int) -> os.stat_result:
        return os.stat_result((stat.S_IFREG | mode, 0, 0, 1, uid, 0, 0, 0, 0, 0))

    owners = (1000, 0)
    assert trust.distrust(status(1000, 0o644), owners) is None
    assert trust.distrust(status(0, 0o755), owners) is None
    assert trust.distrust(status(1000, 0o600), owners) is None
    assert "owned by uid 1001" in str(trust.distrust(status(1001, 0o600), owners))
    assert "group or others" in str(trust.distrust(status(0, 0o664), owners))
    assert "group or others" in str(trust.distrust(status(1000, 0o602), owners))


# ---- each reader goes through it --------------------------------------------------------------


def test_meshkit_yaml_writable_by_others_is_a_refusal_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "meshkit.yaml"
    path.write_text("session: planted\n")
    path.chmod(0o666)
    with pytest.raises(UntrustedFileError, match="chmod go-w"):
        settings.load(environ={}, cwd=str(tmp_path))
    path.chmod(0o644)
    assert settings.load(environ={}, cwd=str(tmp_path)).session == "planted"


def test_every_ssh_config_read_is_checked(tmp_path: Path) -> None:
    path = tmp_path / "ssh_config"
    path.write_text("Host a\n  HostName 10.1.2.3\n")
    path.chmod(0o664)
    with pytest.raises(UntrustedFileError, match="ssh_config mode 0664"):
        ssh_config([str(path)])
    path.chmod(0o644)
    assert ssh_config([str(path)]).lookup("a")["hostname"] == "10.1.2.3"


@as_root
def test_root_reads_no_hostfile_another_user_owns(tmp_path: Path) -> None:
    path = tmp_path / "hostfile"
    path.write_text("10.0.0.1\n")
    os.chown(path, NOBODY, NOBODY)
    with pytest.raises(UntrustedFileError, match="hostfile owned by uid"):
        read_hosts(path)
    os.chown(path, 0, 0)
    path.chmod(0o664)
    with pytest.raises(UntrustedFileError, match="chmod go-w"):
        read_hosts(path)
    path.chmod(0o644)
    assert [host.host for host in read_hosts(path)] == ["10.0.0.1"]


# ---- planted files run nothing: the commands end to end ---------------------------------------


def test_a_trusted_ssh_config_is_obeyed(project: Path) -> None:
    """The control: the marker appears when the file is trusted, so its absence below is the
    refusal's doing."""
    marker = project / "marker"
    config = project / "ssh_config"
    config.write_text(f'Match exec "touch {marker}"\n  User x\n')
    result = meshkit("exec", "--cmd", "true", "--timeout", "5", cwd=project)
    assert result.returncode == 1  # nothing answers on port 1
    assert marker.exists()


@as_root
@pytest.mark.parametrize("task", [["exec", "--cmd", "true"], ["check"], ["doctor", "--quick"]])
def test_a_planted_ssh_config_beside_the_hostfile_runs_nothing(
    project: Path, task: list[str]
) -> None:
    marker = project / "marker"
    config = planted_ssh_config(project, marker)
    os.chown(config, NOBODY, NOBODY)
    result = meshkit(*task, cwd=project)
    refused(result, config, f"chown 0 {config}")
    assert not marker.exists()
    os.chown(config, 0, 0)
    config.chmod(0o666)
    result = meshkit(*task, cwd=project)
    refused(result, config, f"chmod go-w {config}")
    assert not marker.exists()


@as_root
@pytest.mark.parametrize("task", [["exec", "--cmd", "true"], ["env"], ["doctor", "--quick"]])
def test_a_planted_meshkit_yaml_runs_nothing(project: Path, task: list[str]) -> None:
    """A meshkit.yaml of another user's, naming an ssh_config (trusted in itself) whose lookup
    would make the marker, and a node-side python that would."""
    marker = project / "marker"
    other = project / "other_config"
    other.write_text(f'Match exec "touch {marker}"\n  User x\n')
    python = project / "python"
    python.write_text(f"#!/bin/sh\ntouch {marker}\n")
    python.chmod(0o755)
    conf = project / "meshkit.yaml"
    conf.write_text(f"ssh_config: {other}\npython: {python}\nconnect_timeout: 3\n")
    os.chown(conf, NOBODY, NOBODY)
    result = meshkit(*task, cwd=project)
    refused(result, conf, f"chown 0 {conf}")
    assert not marker.exists()


@as_root
def test_root_runs_nothing_from_a_hostfile_another_user_owns(project: Path) -> None:
    hostfile = project / "hostfile"
    os.chown(hostfile, NOBODY, NOBODY)
    for task in (["exec", "--cmd", "true"], ["env"], ["check"]):
        refused(meshkit(*task, cwd=project), hostfile, f"chown 0 {hostfile}")


@as_root
def test_as_another_user_only_its_own_or_roots_unwritable_config_is_obeyed() -> None:
    """``nobody`` running meshkit: a meshkit.yaml of root's is obeyed, one of a third user's or
    one others can write is refused; its hostfile is not checked (only root's is)."""
    with readable_python("nobody") as python:
        project = Path(python).parent.parent.parent / "project"
        project.mkdir(mode=0o755)
        hostfile = project / "hostfile"
        hostfile.write_text("127.0.0.1\n")
        os.chown(hostfile, ANOTHER, ANOTHER)
        conf = project / "meshkit.yaml"
        conf.write_text("session: fromconf\n")
        conf.chmod(0o644)

        def env() -> subprocess.CompletedProcess[str]:
            argv = [*as_user("nobody"), str(python), "-m", "meshkit", "env", "--json"]
            argv += ["--node-rank", "0"]
            return subprocess.run(
                argv,
                cwd=project,
                env=login_env("nobody", Path(python)),
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )

        obeyed = env()
        assert obeyed.returncode == 0, obeyed.stderr  # root's file, and a hostfile of anyone's
        os.chown(conf, ANOTHER, ANOTHER)
        refused(env(), conf, f"chown {NOBODY} {conf}")
        os.chown(conf, 0, 0)
        conf.chmod(0o646)
        refused(env(), conf, f"chmod go-w {conf}")
