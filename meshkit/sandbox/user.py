"""The sandbox's ordinary user (``up(user=True)``): most people on shared GPU nodes are not
root.

``meshkit-user`` is an account on this machine, created by ``up`` if absent (``down`` removes
it again when a sandbox created it and no other sandbox is running). It has a home of its own
on every node, not shared: a per-node directory bind-mounted over its home inside each node,
as /root/.ssh is, whose ~/.ssh/authorized_keys holds the user's own key, so that the user logs
in by key through each node's sshd. On the controller (this machine) its files are in the
sandbox's ``user/``, its own and private: that key, a known_hosts of the nodes' host keys, a
hostfile and the ssh_config beside it. Nodes do not see ``user/``: they know nothing of each
other until the user's ``meshkit mesh``."""

from __future__ import annotations

import os
import pwd
from dataclasses import dataclass
from pathlib import Path

from ..errors import SandboxError
from .bashrc import CONDA_BASHRC, NODE_BASHRC
from .layout import Layout
from .node_files import Login, hostfile_text, ssh_config_text
from .system import need, run, write

NAME = "meshkit-user"
COMMENT = "meshkit sandbox user"  # how down knows that a sandbox created the account
PROGRAMS = {"useradd": "passwd", "userdel": "passwd"}


@dataclass(frozen=True)
class Account:
    name: str
    uid: int
    gid: int
    home: Path


def account() -> Account | None:
    """The user's account on this machine (every node shares /etc/passwd), if there is one."""
    try:
        entry = pwd.getpwnam(NAME)
    except KeyError:
        return None
    return Account(entry.pw_name, entry.pw_uid, entry.pw_gid, Path(entry.pw_dir))


def check_place(sandbox: Layout) -> None:
    """Refuse a sandbox directory the user could not reach its own files in (before anything
    is made)."""
    blocked = []
    for parent in sandbox.root.parents:
        if parent.exists() and not parent.stat().st_mode & 0o001:
            blocked.append(parent)
    if blocked:
        raise SandboxError(
            f"{blocked[0]} is closed to other users, so the sandbox's user could not reach its "
            f"files in {sandbox.user_dir}; put the sandbox in a directory such as /var/tmp "
            "(--dir)"
        )


def ensure_account() -> None:
    """Create the user unless it exists. Its password field is ``*``: no password, yet not
    locked (sshd without PAM refuses a locked account's keys too). Its home here is the mount
    point of each node's own."""
    if account() is None:
        need(PROGRAMS, "the sandbox's user needs programs")
        argv = ["useradd", "--create-home", "--shell", "/bin/bash", "--password", "*"]
        # It fails when another sandbox created the user meanwhile, which is as good.
        created = run([*argv, "--comment", COMMENT, NAME], check=False)
        if account() is None:
            raise SandboxError(f"useradd {NAME} failed: {created.stderr.strip()}")
    home = _existing().home
    if not home.is_dir():
        raise SandboxError(
            f"{NAME}'s home {home} is not a directory; each node mounts the user's own "
            f"there: create it, or remove the account (userdel {NAME})"
        )


def remove_account() -> bool:
    """Remove the user and its home here, when a sandbox created it (its comment says so) and
    none of its processes runs; returns whether it did."""
    try:
        entry = pwd.getpwnam(NAME)
    except KeyError:
        return False
    if entry.pw_gecos != COMMENT:
        return False
    return run(["userdel", "--remove", NAME], check=False).returncode == 0


def _existing() -> Account:
    found = account()
    if found is None:
        raise SandboxError(f"the sandbox's user {NAME} is gone; bring the sandbox up again")
    return found


def write_files(sandbox: Layout) -> None:
    """The user's controller files and its home on every node, all owned by the user."""
    user = _existing()
    sandbox.root.chmod(0o755)  # the way to its own user/
    _private_dir(sandbox.user_dir, user)
    keygen = ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"{NAME}@controller"]
    run([*keygen, "-f", str(sandbox.user_key)])
    for half in (sandbox.user_key, sandbox.user_key.with_suffix(".pub")):
        os.chown(half, user.uid, user.gid)
    login = Login(NAME, sandbox.user_key, sandbox.user_known_hosts)
    config = ssh_config_text(sandbox, sandbox.user_ssh_config, login)
    _write_own(sandbox.user_known_hosts, sandbox.known_hosts.read_text(), user)
    _write_own(sandbox.user_hostfile, hostfile_text(sandbox), user)
    _write_own(sandbox.user_ssh_config, config, user)
    key = sandbox.user_key.with_suffix(".pub").read_text()
    bashrc = NODE_BASHRC
    if sandbox.bashrc == "conda":
        bashrc = CONDA_BASHRC
    for node in sandbox.nodes:
        home = sandbox.user_home(node)
        _private_dir(home, user)
        _private_dir(home / ".ssh", user)
        _write_own(home / ".ssh" / "authorized_keys", key, user)
        _write_own(home / ".bashrc", bashrc, user)


def _private_dir(path: Path, user: Account) -> None:
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o700)
    os.chown(path, user.uid, user.gid)


def _write_own(path: Path, text: str, user: Account) -> None:
    write(path, text, 0o600)
    os.chown(path, user.uid, user.gid)


def mount_point() -> str:
    """Where each node mounts the user's home of its own: the account's home."""
    return str(_existing().home)
