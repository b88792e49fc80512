"""The sandbox's ways into the system: a command (ip, ssh-keygen, ...) by argv only, bounded in
time, a failure as a ``SandboxError`` that says which command and why; a node's namespaces; a
file."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from ..errors import SandboxError
from .layout import Node

COMMAND_TIMEOUT = 30.0
SSHD = "/usr/sbin/sshd"


def run(
    argv: Sequence[str], *, check: bool = True, input: str | None = None
) -> subprocess.CompletedProcess[str]:
    try:
        done = subprocess.run(
            list(argv),
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT,
            input=input,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise SandboxError(f"{' '.join(argv)}: no answer in {COMMAND_TIMEOUT:.0f}s") from None
    if check and done.returncode != 0:
        output = done.stderr.strip() or done.stdout.strip()
        raise SandboxError(f"{' '.join(argv)} failed: {output}")
    return done


def ip_batch(lines: Sequence[str], netns: str | None = None) -> None:
    """Many ``ip`` commands in one process (``-batch``), on the host or inside ``netns``."""
    where = []
    if netns:
        where = ["-n", netns]
    run(["ip", *where, "-batch", "-"], input="\n".join(lines) + "\n")


def need(programs: Mapping[str, str], what: str) -> None:
    """Refuse when a program is missing, naming the Debian packages that provide them (the sbin
    directories are searched too: a root shell's PATH may lack them)."""
    directories = ("/usr/sbin", "/usr/bin", "/sbin", "/bin")
    missing = set()
    for program, package in programs.items():
        if any(Path(directory, program).exists() for directory in directories):
            continue
        if shutil.which(program):
            continue
        missing.add(package)
    if missing:
        raise SandboxError(f"{what}; install them: apt-get install {' '.join(sorted(missing))}")


def write(path: Path, text: str, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(mode)


def netns_pids(netns: str) -> list[int]:
    listed = run(["ip", "netns", "pids", netns], check=False).stdout
    return [int(pid) for pid in listed.split()]


def _exe(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/exe")
    except OSError:  # exited meanwhile
        return None


def _parent(pid: int) -> int | None:
    """The parent of process ``pid`` (None: it exited meanwhile)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # "PID (COMM) STATE PPID ...": COMM may hold spaces and parentheses, so split after its last
    return int(stat.rsplit(")", 1)[1].split()[1])


def nsenter(node: Node) -> list[str]:
    """The argv prefix that runs a command inside a node (its net, mount, UTS and PID namespaces),
    entered through its sshd (the node's PID 1), as its console would. That sshd is the one whose
    parent is not another of the node's: the lowest pid is not it once pids have wrapped, when a
    session's sshd, which may be gone by the time nsenter opens it, can have a lower one."""
    sshd = os.path.realpath(SSHD)
    pids = [pid for pid in netns_pids(node.netns) if _exe(pid) == sshd]
    masters = []
    for pid in pids:
        parent = _parent(pid)
        if parent is not None and parent not in pids:
            masters.append(pid)
    if not masters:
        raise SandboxError(f"{node.name} has no sshd; is it up?")
    return ["nsenter", "-t", str(min(masters)), "--net", "--mount", "--uts", "--pid", "--"]
