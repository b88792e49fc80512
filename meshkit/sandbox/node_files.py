"""The files a sandbox boots from: each node's host keys, sshd_config, /etc/hosts, ~/.bashrc and
authorized_keys, and the controller's bootstrap key, known_hosts, hostfile and ssh_config."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ..errors import SandboxError
from . import networks as netopts
from .bashrc import CONDA_BASHRC, NODE_BASHRC
from .layout import KEXES, Layout, Node
from .system import COMMAND_TIMEOUT, write

SSHD_CONFIG = """\
# meshkit sandbox node {name}
ListenAddress {address}
Port 22
HostKey /etc/ssh/ssh_host_ed25519_key
HostKey /etc/ssh/ssh_host_ecdsa_key
PidFile none
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes yes
LogLevel VERBOSE
MaxStartups 64:30:128
MaxSessions 64
X11Forwarding no
PrintMotd no
AcceptEnv LANG LC_*
Subsystem sftp {sftp}
{kex}"""
# A stock Debian node's SFTP server: sshd starts it through the user's shell (which reads
# ~/.bashrc); internal-sftp, the minimal nodes' one, starts no shell.
SFTP_SERVER = "/usr/lib/openssh/sftp-server"
HOST_KEYS = ("ed25519", "ecdsa")


# Each node's own directories (bind-mounted over the host's inside the node), and their modes.
NODE_DIRECTORIES = {"ssh": 0o700, "etc_ssh": 0o755, "tmp": 0o1777, "hosttmp": 0o755}


def _keygen(path: Path, kind: str, comment: str) -> subprocess.Popen[bytes]:
    argv = ["ssh-keygen", "-q", "-t", kind, "-N", "", "-C", comment, "-f", str(path)]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def prepare_files(sandbox: Layout) -> None:
    """Write every file of the sandbox; the keys are generated in parallel."""
    conda = sandbox.bashrc == "conda"
    sftp = "internal-sftp"
    if conda and Path(SFTP_SERVER).exists():
        sftp = SFTP_SERVER
    for sub in ("controller", "nodes", "logs", "shared"):
        (sandbox.root / sub).mkdir(parents=True, exist_ok=True)
    (sandbox.root / "controller").chmod(0o700)
    keygens = [_keygen(sandbox.key, "ed25519", "meshkit-sandbox-controller")]
    for node in sandbox.nodes:
        keygens += _write_node_files(sandbox, node, sftp)
    # Stops at the first failure, as any() does.
    if any(keygen.wait(COMMAND_TIMEOUT) != 0 for keygen in keygens):
        raise SandboxError("ssh-keygen failed while creating sandbox keys")
    _write_key_files(sandbox)
    _write_controller_files(sandbox)


def _write_node_files(sandbox: Layout, node: Node, sftp: str) -> list[subprocess.Popen[bytes]]:
    """A node's directories and configuration; returns its host keys' ssh-keygen processes."""
    node_dir = sandbox.node_dir(node)
    for sub, mode in NODE_DIRECTORIES.items():
        (node_dir / sub).mkdir(parents=True, exist_ok=True)
        (node_dir / sub).chmod(mode)
    for name in ("ssh_config", "moduli"):
        if Path("/etc/ssh", name).exists():
            shutil.copy(Path("/etc/ssh", name), node_dir / "etc_ssh" / name)
    kex = KEXES[sandbox.kex]
    config = SSHD_CONFIG.format(name=node.name, address=node.address, sftp=sftp, kex=kex)
    write(node_dir / "etc_ssh" / "sshd_config", config)
    write(node_dir / "hosts", netopts.hosts_text(sandbox, node))
    if sandbox.bashrc == "conda":
        write(node_dir / "bashrc", CONDA_BASHRC)
    else:
        write(node_dir / "bashrc", NODE_BASHRC)
    keygens = []
    for kind in HOST_KEYS:
        key = node_dir / "etc_ssh" / f"ssh_host_{kind}_key"
        keygens.append(_keygen(key, kind, f"root@{node.name}"))
    return keygens


def _write_key_files(sandbox: Layout) -> None:
    """The bootstrap key in every node's authorized_keys; every node's host keys in the
    controller's known_hosts."""
    bootstrap = sandbox.key.with_suffix(".pub").read_text()
    known = []
    for node in sandbox.nodes:
        node_dir = sandbox.node_dir(node)
        write(node_dir / "ssh" / "authorized_keys", bootstrap, 0o600)
        for kind in HOST_KEYS:
            public_key = (node_dir / "etc_ssh" / f"ssh_host_{kind}_key.pub").read_text()
            key_type_and_blob = " ".join(public_key.split()[:2])
            known.append(f"{node.address} {key_type_and_blob}\n")
    write(sandbox.known_hosts, "".join(known), 0o600)


def _write_controller_files(sandbox: Layout) -> None:
    """The hostfile (rank order) and the ssh_config meshkit reads beside it."""
    write(sandbox.hostfile, hostfile_text(sandbox))
    login = Login("root", sandbox.key, sandbox.known_hosts)
    write(sandbox.ssh_config, ssh_config_text(sandbox, sandbox.ssh_config, login))


def hostfile_text(sandbox: Layout) -> str:
    addresses = "".join(f"{node.address}\n" for node in sandbox.nodes)
    return f"# meshkit sandbox cluster (rank order; node0 is the master)\n{addresses}"


@dataclass(frozen=True)
class Login:
    """Who logs in to the nodes from the controller: the user, its key, the known_hosts that
    holds the nodes' host keys."""

    user: str
    key: Path
    known_hosts: Path


def ssh_config_text(sandbox: Layout, path: Path, login: Login) -> str:
    """The ssh_config at ``path``, beside a hostfile: the nodes by name, logged in to as
    ``login`` says, host keys checked strictly."""
    aliases = "".join(f"Host {node.name}\n  HostName {node.address}\n" for node in sandbox.nodes)
    names = [node.name for node in sandbox.nodes]
    every = " ".join(names + [node.address for node in sandbox.nodes])
    return (
        f"# meshkit sandbox: ssh -F {path} node0"
        "  (read by meshkit beside the hostfile)\n"
        f"{aliases}Host {every}\n  User {login.user}\n  IdentityFile {login.key}\n"
        "  IdentitiesOnly yes\n"
        f"  UserKnownHostsFile {login.known_hosts}\n  StrictHostKeyChecking yes\n"
    )
