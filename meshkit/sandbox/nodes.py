"""A sandbox node's life: booting it (sshd as the PID 1 of its own namespaces), waiting for its
sshd, killing every process of it, running a command inside it, and its status."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import SandboxError
from . import user
from .layout import Layout, Node
from .networks import silent
from .system import COMMAND_TIMEOUT, netns_pids, nsenter

READY_TIMEOUT = 10.0  # plus READY_PER_NODE for each node booting at once
READY_PER_NODE = 0.1

# Runs inside a node's fresh mount+UTS namespace; its data arrives as positional arguments only.
NODE_INIT = r"""
set -e
name=$1 node=$2 hide=$3 home=$4
shift 4
hostname "$name"
mount --bind /tmp "$node/hosttmp"
mount --bind "$node/tmp" /tmp
for shared in "$@"; do
  mkdir -p "$shared"
  mount --bind "$node/hosttmp/${shared#/tmp/}" "$shared"
done
mount --bind "$node/ssh" /root/.ssh
# The sandbox's user (when it has one): a home of its own on this node, as root's ~/.ssh.
if [ -n "$home" ]; then mount --bind "$node/home" "$home"; fi
mount --bind "$node/etc_ssh" /etc/ssh
mount --bind "$node/hosts" /etc/hosts
# Its own kernel log, and its own faults' files where it can see them (see faults.py).
if [ -f "$node/kmsg" ]; then mount --bind "$node/kmsg" /dev/kmsg; fi
if [ -d "$node/faults" ]; then mount --bind "$node/faults" "$hide/faults"; fi
# This machine's own ~/.bashrc (pyenv init, say) would run at every login of every node; pyenv's
# rehash lock then stalls logins for 60s whenever one is left behind. Nodes get a plain one.
if [ -f /root/.bashrc ]; then mount --bind "$node/bashrc" /root/.bashrc; fi
mount -t tmpfs -o size=64k,mode=700 meshkit-hidden "$hide/controller"
mount -t tmpfs -o size=64k,mode=700 meshkit-hidden "$hide/nodes"
if [ -n "$home" ]; then mount -t tmpfs -o size=64k,mode=700 meshkit-hidden "$hide/user"; fi
exec /usr/sbin/sshd -D -f /etc/ssh/sshd_config -E "$hide/logs/$name.sshd.log"
"""


def _shared_under_tmp() -> list[str]:
    """Paths the nodes must see although they live under /tmp (which each node has its own of):
    the interpreter's environment, meshkit itself and the working directory. A path inside
    another listed one is left out: binding the outer one shows it too."""
    meshkit = Path(__file__).resolve().parent.parent.parent
    candidates = {Path(sys.prefix).resolve(), meshkit, Path.cwd().resolve()}
    under = []
    for candidate in candidates:
        if candidate.is_relative_to("/tmp") and candidate != Path("/tmp"):
            under.append(str(candidate))
    under.sort()
    outermost = []
    for path in under:
        inside_another = any(path != other and path.startswith(other + "/") for other in under)
        if not inside_another:
            outermost.append(path)
    return outermost


def start_node(sandbox: Layout, node: Node) -> None:
    """Boot a node: fresh mount, UTS and PID namespaces inside its network namespace, with sshd
    in the foreground as the node's PID 1 (a node's processes see only each other, as on a real
    machine; the node dies with its sshd)."""
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege-separation directory
    fresh = ["--mount", "--uts", "--pid", "--fork", "--mount-proc", "--propagation", "private"]
    node_dir = str(sandbox.node_dir(node))
    home = ""
    if sandbox.user:
        home = user.mount_point()
    init = ["sh", "-c", NODE_INIT, "node-init", node.name, node_dir, str(sandbox.root), home]
    argv = ["ip", "netns", "exec", node.netns, "unshare", *fresh, *init, *_shared_under_tmp()]
    with open(sandbox.root / "logs" / f"{node.name}.boot.log", "w") as log:
        subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True
        )


def answers(node: Node) -> bool:
    """Whether the node's sshd accepts a TCP connection."""
    try:
        socket.create_connection((node.address, 22), timeout=0.5).close()
    except OSError:
        return False
    return True


def wait_ready(sandbox: Layout, nodes: Sequence[Node]) -> None:
    """Until every node's sshd accepts TCP (bounded by READY_TIMEOUT and READY_PER_NODE: 244
    nodes booting at once on two cores take longer than 4)."""
    limit = READY_TIMEOUT + READY_PER_NODE * len(nodes)
    deadline = time.monotonic() + limit
    waiting = list(nodes)
    while True:
        waiting = [node for node in waiting if not answers(node)]
        if not waiting:
            return
        if time.monotonic() > deadline:
            names = ", ".join(node.name for node in waiting)
            raise SandboxError(
                f"sshd did not come up on {names} in {limit:.0f}s; "
                f"see {sandbox.root}/logs/*.boot.log"
            )
        time.sleep(0.05)


def kill_node(netns: str) -> None:
    """Every process of a node, as a power cut would (bounded wait)."""
    deadline = time.monotonic() + 5.0
    pids = netns_pids(netns)
    while pids and time.monotonic() < deadline:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
        pids = netns_pids(netns)
    if netns_pids(netns):
        raise SandboxError(f"processes of {netns} survived SIGKILL for 5s")


@dataclass(frozen=True)
class NodeStatus:
    node: str
    address: str
    sshd: bool
    processes: int
    power: str  # "off" after sandbox.poweroff (or with no process left), else "on"


def status(sandbox: Layout) -> list[NodeStatus]:
    statuses = []
    for node in sandbox.nodes:
        sshd = answers(node)
        processes = len(netns_pids(node.netns))
        power = "on"
        if silent(node) or processes == 0:
            power = "off"
        statuses.append(NodeStatus(node.name, node.address, sshd, processes, power))
    return statuses


def node_exec(
    node: Node, argv: Sequence[str], timeout: float = COMMAND_TIMEOUT
) -> subprocess.CompletedProcess[str]:
    """Run a command *inside* a node (its net, mount and UTS namespaces), as its console would."""
    argv = [*nsenter(node), *argv]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
