"""A local cluster of real sshd nodes on this machine (root only), for the tests and for trying
meshkit without machines: what kind/minikube are for Kubernetes.

Node ``i`` is a network namespace (``meshkit-n<i>``) with its own address on the sandbox's bridge and a
mount+UTS namespace (started inside it) with its own hostname and, by bind mounts, its own
``/tmp``, ``/root/.ssh``, ``/etc/ssh`` (host keys, sshd_config) and ``/etc/hosts``. The rest of the
filesystem is shared, like NFS on a real cluster. Each node runs a real OpenSSH ``sshd`` that
accepts keys only. The controller (this machine, outside the namespaces) logs in with a bootstrap
key and knows the nodes' host keys; the nodes know nothing of each other until ``meshkit mesh``.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import SandboxError
from . import networks as netopts
from . import slurm as slurm_cluster
from .layout import (
    BASHRCS,
    DEFAULT,
    MAX_NODES,
    Layout,
    Node,
    Options,
    check_name,
    default_dir,
    default_subnet,
    layout,
)
from .networks import cut, mend, shape, unshape
from .system import COMMAND_TIMEOUT, SSHD, ip_batch, need, netns_pids, nsenter, write
from .system import run as _run

# Defined in a submodule; the CLI, the tests and the benchmarks use them as sandbox.X.
__all__ = [
    "BASHRCS",
    "DEFAULT",
    "MAX_NODES",
    "SSHD",
    "Layout",
    "Node",
    "Options",
    "check_name",
    "cut",
    "default_dir",
    "default_subnet",
    "layout",
    "mend",
    "netns_pids",
    "shape",
    "unshape",
]

PROGRAMS = {
    "sshd": "openssh-server",
    "ssh": "openssh-client",
    "ssh-keygen": "openssh-client",
    "tmux": "tmux",
    "ip": "iproute2",
    "unshare": "util-linux",
    "nsenter": "util-linux",
}
READY_TIMEOUT = 10.0  # plus READY_PER_NODE for each node booting at once
READY_PER_NODE = 0.1

# Runs inside a node's fresh mount+UTS namespace; its data arrives as positional arguments only.
NODE_INIT = r"""
set -e
name=$1 node=$2 hide=$3
shift 3
hostname "$name"
mount --bind /tmp "$node/hosttmp"
mount --bind "$node/tmp" /tmp
for shared in "$@"; do
  mkdir -p "$shared"
  mount --bind "$node/hosttmp/${shared#/tmp/}" "$shared"
done
mount --bind "$node/ssh" /root/.ssh
mount --bind "$node/etc_ssh" /etc/ssh
mount --bind "$node/hosts" /etc/hosts
# This machine's own ~/.bashrc (pyenv init, say) would run at every login of every node; pyenv's
# rehash lock then stalls logins for 60s whenever one is left behind. Nodes get a plain one.
if [ -f /root/.bashrc ]; then mount --bind "$node/bashrc" /root/.bashrc; fi
mount -t tmpfs -o size=64k,mode=700 meshkit-hidden "$hide/controller"
mount -t tmpfs -o size=64k,mode=700 meshkit-hidden "$hide/nodes"
exec /usr/sbin/sshd -D -f /etc/ssh/sshd_config -E "$hide/logs/$name.sshd.log"
"""

NODE_BASHRC = "# meshkit sandbox node: the host's ~/.bashrc does not run on the nodes\n"

# Where the conda-like bashrc counts shells: one line per shell, the command it was started for.
SHELLS_FILE = ".meshkit-shells"  # in the node's own /tmp
# What `conda init` leaves in ~/.bashrc, in cost: a Python process per shell (conda's hook is
# `conda shell.bash hook`; pyenv's `pyenv init -`), with no `case $- in *i*` guard, so every
# shell sshd starts for an exec channel pays it. The hook burns a fixed 0.09 s of its own CPU
# (plus the interpreter's start-up, about 0.1 s in all), the same on a busy machine as on an
# idle one; its output is eval'ed as conda's is.
CONDA_BASHRC = r"""# meshkit sandbox node: a conda-init-like ~/.bashrc (no interactive guard)
__mk_cmd=${BASH_EXECUTION_STRING:-interactive}
__mk_cmd=${__mk_cmd//$'\n'/ }
printf '%s\n' "${__mk_cmd:0:200}" >> /tmp/.meshkit-shells 2>/dev/null
unset __mk_cmd
# >>> conda initialize >>>
__conda_setup="$(/usr/bin/python3 -c '
import time
start = time.process_time()
while time.process_time() - start < 0.09:
    pass
print("export CONDA_SHLVL=1")
' 2>/dev/null)"
if [ $? -eq 0 ]; then
    eval "$__conda_setup"
fi
unset __conda_setup
# <<< conda initialize <<<
"""

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
"""
# A stock Debian node's SFTP server: sshd starts it through the user's shell (which reads
# ~/.bashrc); internal-sftp, the minimal nodes' one, starts no shell.
SFTP_SERVER = "/usr/lib/openssh/sftp-server"
HOST_KEYS = ("ed25519", "ecdsa")


def preflight() -> None:
    """Root and the system programs, with the Debian packages that provide them."""
    if os.geteuid() != 0:
        raise SandboxError(
            "the sandbox needs root (network namespaces, bind mounts, sshd): run with sudo"
        )
    need(PROGRAMS, "missing programs")


def check_subnet(lay: Layout) -> None:
    """Refuse a subnet (and the second network's) that overlaps any route or address of this
    machine other than our own bridges."""
    first = ("sandbox subnet", "choose another with --subnet (config meshkit.sandbox.subnet)")
    second = ("the sandbox's second network", "choose another --subnet (it is subnet + 0.1.0.0)")
    nets = [(lay.subnet, lay.bridge, *first)]
    if lay.networks.second:
        nets.append((netopts.second_subnet(lay), lay.second_bridge, *second))
    for route in json.loads(_run(["ip", "-j", "route", "show", "table", "all"]).stdout or "[]"):
        dst, dev = str(route.get("dst", "")), str(route.get("dev", ""))
        if dst in ("", "default") or route.get("type") in ("local", "broadcast", "multicast"):
            continue
        try:
            other = ipaddress.ip_network(dst, strict=False)
        except ValueError:
            continue
        for net, bridge, what, fix in nets:
            if dev != bridge and other.version == 4 and other.overlaps(net):
                raise SandboxError(f"{what} {net} overlaps route {dst} on {dev}; {fix}")


def _shared_under_tmp() -> list[str]:
    """Paths the nodes must see although they live under /tmp (which each node has its own of):
    the interpreter's environment, meshkit itself and the working directory."""
    meshkit = Path(__file__).resolve().parent.parent.parent
    candidates = {Path(sys.prefix).resolve(), meshkit, Path.cwd().resolve()}
    under = sorted(str(p) for p in candidates if p.is_relative_to("/tmp") and p != Path("/tmp"))
    return [p for p in under if not any(p != q and p.startswith(q + "/") for q in under)]


def _keygen(path: Path, kind: str, comment: str) -> subprocess.Popen[bytes]:
    argv = ["ssh-keygen", "-q", "-t", kind, "-N", "", "-C", comment, "-f", str(path)]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _prepare_files(lay: Layout) -> None:
    conda = lay.bashrc == "conda"
    sftp = SFTP_SERVER if conda and Path(SFTP_SERVER).exists() else "internal-sftp"
    for sub in ("controller", "nodes", "logs", "shared"):
        (lay.root / sub).mkdir(parents=True, exist_ok=True)
    (lay.root / "controller").chmod(0o700)
    keygens = [_keygen(lay.key, "ed25519", "meshkit-sandbox-controller")]
    for node in lay.nodes:
        d = lay.node_dir(node)
        for sub, mode in (("ssh", 0o700), ("etc_ssh", 0o755), ("tmp", 0o1777), ("hosttmp", 0o755)):
            (d / sub).mkdir(parents=True, exist_ok=True)
            (d / sub).chmod(mode)
        for name in ("ssh_config", "moduli"):
            if Path("/etc/ssh", name).exists():
                shutil.copy(Path("/etc/ssh", name), d / "etc_ssh" / name)
        config = SSHD_CONFIG.format(name=node.name, address=node.address, sftp=sftp)
        write(d / "etc_ssh" / "sshd_config", config)
        write(d / "hosts", netopts.hosts_text(lay, node))
        write(d / "bashrc", CONDA_BASHRC if conda else NODE_BASHRC)
        for kind in HOST_KEYS:
            keygens.append(
                _keygen(d / "etc_ssh" / f"ssh_host_{kind}_key", kind, f"root@{node.name}")
            )
    if any(p.wait(COMMAND_TIMEOUT) != 0 for p in keygens):
        raise SandboxError("ssh-keygen failed while creating sandbox keys")
    bootstrap = lay.key.with_suffix(".pub").read_text()
    known = []
    for node in lay.nodes:
        d = lay.node_dir(node)
        write(d / "ssh" / "authorized_keys", bootstrap, 0o600)
        for kind in HOST_KEYS:
            blob = (d / "etc_ssh" / f"ssh_host_{kind}_key.pub").read_text().split()[:2]
            known.append(f"{node.address} {' '.join(blob)}\n")
    write(lay.known_hosts, "".join(known), 0o600)
    addresses = "".join(f"{n.address}\n" for n in lay.nodes)
    write(lay.hostfile, f"# meshkit sandbox cluster (rank order; node0 is the master)\n{addresses}")
    aliases = "".join(f"Host {n.name}\n  HostName {n.address}\n" for n in lay.nodes)
    every = " ".join([n.name for n in lay.nodes] + [n.address for n in lay.nodes])
    write(
        lay.ssh_config,
        f"# meshkit sandbox: ssh -F {lay.ssh_config} node0  (read by meshkit beside the hostfile)\n"
        f"{aliases}Host {every}\n  User root\n  IdentityFile {lay.key}\n  IdentitiesOnly yes\n"
        f"  UserKnownHostsFile {lay.known_hosts}\n  StrictHostKeyChecking yes\n",
    )


NEIGH_SYSCTLS = Path("/proc/sys/net")


def neighbour_room(nodes: int, root: Path = NEIGH_SYSCTLS) -> list[str]:
    """Make the kernel's neighbour (ARP/NDP) table big enough for every node to know every
    other. Its limits are machine-wide, not per namespace: N nodes that all talk to each other
    (the doctor's N x N reach, gloo) need about N² entries, and past gc_thresh3 (1024 by default,
    i.e. about 32 nodes) the kernel drops new neighbours ("neighbor table overflow") and those
    pairs time out. Only ever raised, never lowered (another sandbox may rely on it); returns
    what it changed."""
    entries = 2 * (nodes + 2) ** 2 + 1024  # a second network per node doubles the entries
    changed = []
    for family in ("ipv4", "ipv6"):
        for name, want in (("gc_thresh3", entries), ("gc_thresh2", entries // 2)):
            path = root / family / "neigh" / "default" / name
            try:
                if int(path.read_text().split()[0]) < want:
                    path.write_text(f"{want}\n")
                    changed.append(f"net.{family}.neigh.default.{name}={want}")
            except (OSError, ValueError, IndexError):
                continue  # not Linux-like, or not allowed: the sandbox still works up to ~32 nodes
    return changed


def _network(lay: Layout) -> None:
    neighbour_room(lay.count)
    for node in lay.nodes:
        _run(["ip", "netns", "add", node.netns])
    ip_batch(netopts.host_batch(lay))
    for node in lay.nodes:
        ip_batch(netopts.node_batch(lay, node), node.netns)


def start_node(lay: Layout, node: Node) -> None:
    """Boot a node: fresh mount, UTS and PID namespaces inside its network namespace, with sshd
    in the foreground as the node's PID 1 (a node's processes see only each other, as on a real
    machine; the node dies with its sshd)."""
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege-separation directory
    fresh = ["--mount", "--uts", "--pid", "--fork", "--mount-proc", "--propagation", "private"]
    init = ["sh", "-c", NODE_INIT, "node-init", node.name, str(lay.node_dir(node)), str(lay.root)]
    argv = ["ip", "netns", "exec", node.netns, "unshare", *fresh, *init, *_shared_under_tmp()]
    with open(lay.root / "logs" / f"{node.name}.boot.log", "w") as log:
        subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True
        )


def _answers(node: Node) -> bool:
    try:
        socket.create_connection((node.address, 22), timeout=0.5).close()
    except OSError:
        return False
    return True


def wait_ready(lay: Layout, nodes: Sequence[Node]) -> None:
    """Until every node's sshd accepts TCP (bounded by READY_TIMEOUT and READY_PER_NODE: 244
    nodes booting at once on two cores take longer than 4)."""
    limit = READY_TIMEOUT + READY_PER_NODE * len(nodes)
    deadline = time.monotonic() + limit
    waiting = list(nodes)
    while waiting := [n for n in waiting if not _answers(n)]:
        if time.monotonic() > deadline:
            names = ", ".join(n.name for n in waiting)
            raise SandboxError(
                f"sshd did not come up on {names} in {limit:.0f}s; see {lay.root}/logs/*.boot.log"
            )
        time.sleep(0.05)


def kill_node(netns: str) -> None:
    """Every process of a node, as a power cut would (bounded wait)."""
    deadline = time.monotonic() + 5.0
    while (pids := netns_pids(netns)) and time.monotonic() < deadline:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
    if netns_pids(netns):
        raise SandboxError(f"processes of {netns} survived SIGKILL for 5s")


def _netns_names() -> list[str]:
    done = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in done.stdout.splitlines() if line.strip()]


def down(root: str | os.PathLike[str], name: str = DEFAULT) -> list[str]:
    """Remove every namespace, link and file of the sandbox ``name``; safe to repeat and after a
    crash. Other sandboxes are left alone. SLURM's daemons (``up(slurm=True)``) run inside the
    nodes, so killing every process of every node ends them too."""
    path = Path(root)
    state = _read_state(path)
    name = str(state.get("name", name)) if state else check_name(name)
    lay = Layout(path.resolve(), ipaddress.IPv4Network("10.77.0.0/24"), 1, name)  # names only
    removed = []
    for netns in filter(lay.owns_netns, _netns_names()):
        kill_node(netns)
        _run(["ip", "netns", "del", netns], check=False)
        removed.append(netns)
    # The kernel frees a deleted namespace's veths lazily; delete our ends now so that an
    # immediate up does not find them still there.
    shown = json.loads(_run(["ip", "-j", "link", "show"], check=False).stdout or "[]")
    links = [str(link.get("ifname", "")) for link in shown]
    for ifname in filter(lay.owns_veth, links):
        _run(["ip", "link", "del", ifname], check=False)
    for bridge in (lay.second_bridge, lay.bridge):
        if bridge in links:
            _run(["ip", "link", "del", bridge], check=False)
            removed.append(bridge)
    if path.exists() and (state is not None or (path / "hostfile").exists()):
        shutil.rmtree(path)
        removed.append(str(path))
    # /root/.ssh is every node's bind-mount point: remove it (if up created it) only when it is
    # empty and no other sandbox is running, or a node of that one could not boot again.
    others = any(n.startswith("meshkit-") for n in _netns_names())
    if state and state.get("created_root_ssh") and not others:
        with contextlib.suppress(OSError):  # not empty, or gone already
            Path("/root/.ssh").rmdir()
    return removed


def _read_state(root: Path) -> dict[str, object] | None:
    try:
        data = json.loads((root / "state.json").read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def up(
    root: str | os.PathLike[str],
    subnet: str,
    count: int,
    name: str = DEFAULT,
    networks: Options | None = None,
    slurm: bool = False,
    bashrc: str = "minimal",
) -> Layout:
    """Create (or re-create) the sandbox ``name`` of ``count`` nodes and wait until every sshd
    answers. ``networks`` adds real-world network features (see networks.py); ``slurm`` also a
    private SLURM cluster on the nodes (see slurm.py); ``bashrc`` the nodes' ~/.bashrc (a key of
    BASHRCS: ``conda`` costs what conda's does and counts shells)."""
    preflight()
    if slurm:
        slurm_cluster.preflight()
    lay = layout(root, subnet, count, name, networks, bashrc)
    down(lay.root, name)
    check_subnet(lay)
    state = {"name": name, "nodes": count, "subnet": str(lay.subnet), "slurm": slurm}
    state |= {"networks": lay.networks.as_state(), "bashrc": bashrc}
    state["created_root_ssh"] = not Path("/root/.ssh").exists()
    # The bind-mount point for each node's own ~/.ssh; another sandbox may create it meanwhile.
    Path("/root/.ssh").mkdir(mode=0o700, exist_ok=True)
    write(lay.root / "state.json", json.dumps(state))
    try:
        _prepare_files(lay)
        _network(lay)
        for node in lay.nodes:
            start_node(lay, node)
        wait_ready(lay, lay.nodes)
        if slurm:
            slurm_cluster.start(lay)
    except BaseException:
        down(lay.root, name)
        raise
    return lay


def load(root: str | os.PathLike[str]) -> Layout:
    state = _read_state(Path(root))
    if state is None:
        raise SandboxError(f"no sandbox at {root}; create one with: meshkit sandbox.up --nodes 3")
    name, bashrc = str(state.get("name", DEFAULT)), str(state.get("bashrc", "minimal"))
    networks = Options.from_state(state.get("networks"))
    return layout(root, str(state["subnet"]), int(str(state["nodes"])), name, networks, bashrc)


def reboot(lay: Layout, index: int) -> Node:
    """What a reboot looks like to meshkit: every process of the node dies, its /tmp is emptied,
    and sshd comes back (with fresh namespaces)."""
    node = lay.node(index)
    kill_node(node.netns)
    tmp = lay.node_dir(node) / "tmp"
    shutil.rmtree(tmp)
    tmp.mkdir()
    tmp.chmod(0o1777)
    start_node(lay, node)
    wait_ready(lay, [node])
    if (_read_state(lay.root) or {}).get("slurm"):
        slurm_cluster.start_daemons(lay, node)
        slurm_cluster.wait_idle(lay, [node])
    return node


def reset_shells(lay: Layout) -> None:
    """Empty every node's shell counter (a reboot empties it too)."""
    for node in lay.nodes:
        (lay.node_dir(node) / "tmp" / SHELLS_FILE).unlink(missing_ok=True)


def shells(lay: Layout) -> list[list[str]]:
    """Per node, in rank order: the shells started since ``reset_shells``, each as the command
    it was started for (``interactive`` for a login shell such as tmux's). Only the ``conda``
    bashrc counts; a ``minimal`` sandbox gives empty lists."""
    files = [lay.node_dir(node) / "tmp" / SHELLS_FILE for node in lay.nodes]
    return [f.read_text(errors="replace").splitlines() if f.exists() else [] for f in files]


@dataclass(frozen=True)
class NodeStatus:
    node: str
    address: str
    sshd: bool
    processes: int


def status(lay: Layout) -> list[NodeStatus]:
    return [NodeStatus(n.name, n.address, _answers(n), len(netns_pids(n.netns))) for n in lay.nodes]


def node_exec(
    node: Node, argv: Sequence[str], timeout: float = COMMAND_TIMEOUT
) -> subprocess.CompletedProcess[str]:
    """Run a command *inside* a node (its net, mount and UTS namespaces), as its console would."""
    argv = [*nsenter(node), *argv]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
