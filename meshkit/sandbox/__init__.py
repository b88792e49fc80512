"""A local cluster of real sshd nodes on this machine (root only), for the tests and for trying
meshkit without machines: what kind/minikube are for Kubernetes.

Node ``i`` is a network namespace (``meshkit-n<i>``) with its own address on the sandbox's bridge
and a mount+UTS namespace (started inside it) with its own hostname and, by bind mounts, its own
``/tmp``, ``/root/.ssh``, ``/etc/ssh`` (host keys, sshd_config) and ``/etc/hosts``. The rest of the
filesystem is shared, like NFS on a real cluster. Each node runs a real OpenSSH ``sshd`` that
accepts keys only. The controller (this machine, outside the namespaces) logs in with a bootstrap
key and knows the nodes' host keys; the nodes know nothing of each other until ``meshkit mesh``.

``up(user=True)`` adds an ordinary user, ``meshkit-user`` (``USER``), created on this machine
if absent: a home of its own on every node (a per-node directory bind-mounted over its home,
as ``/root/.ssh`` is) that accepts its own key, and its controller files (key, known_hosts,
hostfile, ssh_config) in the sandbox's ``user/``, which nodes do not see. ``down`` removes the
account when a sandbox created it and no other sandbox is running.

This module is the sandbox's life (``up``, ``down``, ``load``, ``reboot``, ``poweroff``,
``poweron``, ``fault``, ``slow``) and its state file; the parts live beside it: ``layout`` (names
and addresses), ``faults`` (a node made unhealthy through its own sources: ``kmsg``,
``fake_smi``), ``cpu`` (a node made slow: its CPU capped in a cgroup of its own),
``host_setup`` (what this machine needs), ``node_files`` (the files nodes boot from), ``bashrc``
(the nodes' ~/.bashrc), ``nodes`` (booting, killing and entering a node), ``networks``
(real-world network features, and the silence of a node that is off), ``slurm`` (a private SLURM
cluster), ``user`` (the ordinary user) and ``system`` (commands and files).
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import shutil
from pathlib import Path

from ..errors import SandboxError
from . import cpu as node_cpu
from . import faults
from . import slurm as slurm_cluster
from . import user as sandbox_user
from .bashrc import CONDA_BASHRC, NODE_BASHRC, SHELLS_FILE, reset_shells, shells
from .faults import Fault, NodeFaults
from .host_setup import (
    PROGRAMS,
    check_subnet,
    create_network,
    neighbour_room,
    netns_names,
    preflight,
    subnet_lock,
    with_free_subnet,
)
from .layout import (
    AUTO,
    BASHRCS,
    DEFAULT,
    MAX_NODES,
    Layout,
    NetworkOptions,
    Node,
    check_name,
    default_dir,
    default_subnet,
    layout,
)
from .networks import cut, mend, shape, silence, silent, unshape, unsilence
from .node_files import prepare_files
from .nodes import (
    READY_PER_NODE,
    READY_TIMEOUT,
    NodeStatus,
    kill_node,
    node_exec,
    start_node,
    status,
    wait_ready,
)
from .system import COMMAND_TIMEOUT, SSHD, netns_pids, write
from .system import run as _run
from .user import NAME as USER

# Defined in a submodule; the CLI, the tests and the benchmarks use them as sandbox.X.
__all__ = [
    "AUTO",
    "BASHRCS",
    "COMMAND_TIMEOUT",
    "CONDA_BASHRC",
    "DEFAULT",
    "MAX_NODES",
    "NODE_BASHRC",
    "PROGRAMS",
    "READY_PER_NODE",
    "READY_TIMEOUT",
    "SHELLS_FILE",
    "SSHD",
    "USER",
    "Fault",
    "Layout",
    "NetworkOptions",
    "Node",
    "NodeFaults",
    "NodeStatus",
    "check_name",
    "check_subnet",
    "cut",
    "default_dir",
    "default_subnet",
    "kill_node",
    "layout",
    "mend",
    "neighbour_room",
    "netns_pids",
    "node_exec",
    "preflight",
    "reset_shells",
    "shape",
    "shells",
    "start_node",
    "status",
    "unshape",
    "wait_ready",
]


def down(root: str | os.PathLike[str], name: str = DEFAULT) -> list[str]:
    """Remove every namespace, link and file of the sandbox ``name``; safe to repeat and after a
    crash. Other sandboxes are left alone. SLURM's daemons (``up(slurm=True)``) run inside the
    nodes, so killing every process of every node ends them too."""
    path = Path(root)
    state = _read_state(path)
    name = str(state.get("name", name)) if state else check_name(name)
    # Only the names matter here: the subnet and size are placeholders.
    names = Layout(path.resolve(), ipaddress.IPv4Network("10.77.0.0/24"), 1, name)
    removed = []
    for netns in netns_names():
        if not names.owns_netns(netns):
            continue
        kill_node(netns)
        _run(["ip", "netns", "del", netns], check=False)
        removed.append(netns)
    # The kernel frees a deleted namespace's veths lazily; delete our ends now so that an
    # immediate up does not find them still there.
    shown = json.loads(_run(["ip", "-j", "link", "show"], check=False).stdout or "[]")
    links = [str(link.get("ifname", "")) for link in shown]
    for ifname in links:
        if names.owns_veth(ifname):
            _run(["ip", "link", "del", ifname], check=False)
    for bridge in (names.second_bridge, names.bridge):
        if bridge in links:
            _run(["ip", "link", "del", bridge], check=False)
            removed.append(bridge)
    # A directory is removed only when it is a sandbox's (a state file, or at least a hostfile).
    is_sandbox_dir = state is not None or (path / "hostfile").exists()
    if path.exists() and is_sandbox_dir:
        shutil.rmtree(path)
        removed.append(str(path))
    # /root/.ssh is every node's bind-mount point: remove it (if up created it) only when it is
    # empty and no other sandbox is running, or a node of that one could not boot again.
    others_running = any(netns.startswith("meshkit-") for netns in netns_names())
    if state and state.get("created_root_ssh") and not others_running:
        with contextlib.suppress(OSError):  # not empty, or gone already
            Path("/root/.ssh").rmdir()
    # The same for the sandbox's user: another sandbox's nodes may mount its home.
    if state and state.get("user") and not others_running and sandbox_user.remove_account():
        removed.append(f"user {USER}")
    # Last: its processes are killed above, so its nodes' cgroups (sandbox.slow) are empty.
    removed += node_cpu.remove(name)
    return removed


def _read_state(root: Path) -> dict[str, object] | None:
    try:
        data = json.loads((root / "state.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    return data


def up(
    root: str | os.PathLike[str],
    subnet: str,
    count: int,
    name: str = DEFAULT,
    networks: NetworkOptions | None = None,
    slurm: bool = False,
    bashrc: str = "minimal",
    user: bool = False,
    kex: str = "fast",
) -> Layout:
    """Create (or re-create) the sandbox ``name`` of ``count`` nodes and wait until every sshd
    answers. ``networks`` adds real-world network features (see networks.py); ``slurm`` also a
    private SLURM cluster on the nodes (see slurm.py); ``bashrc`` the nodes' ~/.bashrc (a key of
    BASHRCS: ``conda`` costs what conda's does and counts shells); ``user`` an ordinary user
    with a home of its own on every node (see user.py); ``kex`` the key exchanges their sshd
    offers (a key of KEXES: ``openssh`` keeps OpenSSH's own, as the benchmarks do)."""
    preflight()
    if slurm:
        slurm_cluster.preflight()
    sandbox = layout(root, subnet, count, name, networks, bashrc, user, kex)
    if user:
        sandbox_user.check_place(sandbox)
    down(sandbox.root, name)
    # Under the lock until the bridges have their addresses: two sandboxes coming up at once
    # never take the same subnet.
    with subnet_lock():
        if subnet == AUTO:
            sandbox = with_free_subnet(sandbox)
        check_subnet(sandbox)
        if user:
            sandbox_user.ensure_account()
        _create(sandbox, slurm)
    try:
        for node in sandbox.nodes:
            start_node(sandbox, node)
        wait_ready(sandbox, sandbox.nodes)
        if slurm:
            slurm_cluster.start(sandbox)
    except BaseException:
        down(sandbox.root, name)
        raise
    return sandbox


def _create(sandbox: Layout, slurm: bool) -> None:
    """The sandbox's state file, the files its nodes boot from and its networks (not yet its
    nodes' sshd)."""
    state = {
        "name": sandbox.name,
        "nodes": sandbox.count,
        "subnet": str(sandbox.subnet),
        "slurm": slurm,
        "networks": sandbox.networks.as_state(),
        "bashrc": sandbox.bashrc,
        "kex": sandbox.kex,
        "created_root_ssh": not Path("/root/.ssh").exists(),
        "user": sandbox.user,
    }
    # The bind-mount point for each node's own ~/.ssh; another sandbox may create it meanwhile.
    Path("/root/.ssh").mkdir(mode=0o700, exist_ok=True)
    write(sandbox.root / "state.json", json.dumps(state))
    try:
        prepare_files(sandbox)
        for node in sandbox.nodes:
            faults.prepare(sandbox, node)
        if sandbox.user:
            sandbox_user.write_files(sandbox)
        create_network(sandbox)
    except BaseException:
        down(sandbox.root, sandbox.name)
        raise


def load(root: str | os.PathLike[str]) -> Layout:
    state = _read_state(Path(root))
    if state is None:
        raise SandboxError(f"no sandbox at {root}; create one with: meshkit sandbox.up --nodes 3")
    name = str(state.get("name", DEFAULT))
    bashrc = str(state.get("bashrc", "minimal"))
    networks = NetworkOptions.from_state(state.get("networks"))
    subnet = str(state["subnet"])
    count = int(str(state["nodes"]))
    user = bool(state.get("user", False))
    kex = str(state.get("kex", "openssh"))  # a sandbox made before the choice has OpenSSH's
    return layout(root, subnet, count, name, networks, bashrc, user, kex)


def reboot(sandbox: Layout, index: int) -> Node:
    """What a reboot looks like to meshkit: every process of the node dies, its /tmp and its
    kernel log are emptied, and sshd comes back (with fresh namespaces; the faults that are the
    machine's, ``fault``'s GPUs, port and full disks, mounted again). A powered-off node is
    powered on."""
    node = sandbox.node(index)
    kill_node(node.netns)
    _boot(sandbox, node)
    return node


def poweroff(sandbox: Layout, index: int) -> Node:
    """What a machine switched off looks like to meshkit: every process of the node dies (its
    sshd, agents, tmux, the job's ranks and supervisors), none comes back until ``poweron``, and
    connections to its addresses time out rather than being refused. Safe to repeat."""
    node = sandbox.node(index)
    # Silent first: no peer sees a refusal while the processes are being killed.
    silence(node)
    kill_node(node.netns)
    return node


def poweron(sandbox: Layout, index: int) -> Node:
    """Switch a powered-off node on: it boots as after ``reboot`` (an empty /tmp, sshd and, with
    SLURM, its daemons) and answers again. A node that is on is left as it is."""
    node = sandbox.node(index)
    if not powered_off(sandbox, index):
        return node
    kill_node(node.netns)  # nothing runs on a node that is off; this only makes sure
    _boot(sandbox, node)
    return node


def fault(
    sandbox: Layout,
    index: int,
    *,
    clear: bool = False,
    gpus: int | None = None,
    ecc: int | None = None,
    xid: int | None = None,
    pci: str | None = None,
    oom: bool = False,
    pid: int = faults.DEFAULT_PID,
    ib_down: bool = False,
    ib_errors: int | None = None,
    disk_full: str | None = None,
) -> NodeFaults:
    """Make node ``index`` unhealthy through its own sources, or well again (``clear``), as
    ``sandbox.fault`` does (see faults.py): ``clear`` first, then ``gpus`` (the fake nvidia-smi
    with that many), ``ecc`` (uncorrected on GPU 0), ``xid`` (at ``pci``) and ``oom`` (of
    ``pid``) in its kernel log, ``ib_down`` and ``ib_errors`` on its InfiniBand port,
    ``disk_full`` (a path). A reboot empties its kernel log and keeps the rest."""
    change = Fault(
        clear=clear,
        gpus=gpus,
        ecc=ecc,
        xid=xid,
        pci=pci,
        oom=oom,
        pid=pid,
        ib_down=ib_down,
        ib_errors=ib_errors,
        disk_full=disk_full,
    )
    return faults.fault(sandbox, index, change)


def slow(sandbox: Layout, index: int, cpu: float) -> node_cpu.Cap:
    """Cap node ``index``'s CPU at ``cpu`` of ONE CPU (its processes together; 0.33: a third),
    or lift the cap (``cpu`` 1 or more), as ``sandbox.slow`` does (see cpu.py). Made live: every
    process of the node is moved into its cgroup now, later ones through its sshd inherit it, and
    a reboot keeps it."""
    return node_cpu.slow(sandbox, index, cpu)


def powered_off(sandbox: Layout, index: int) -> bool:
    """Whether the node is off: silent (``poweroff``), or without a process (its sshd, the
    node's PID 1, is gone)."""
    node = sandbox.node(index)
    return silent(node) or not netns_pids(node.netns)


def _boot(sandbox: Layout, node: Node) -> None:
    """Start a node whose processes are all gone, as a machine boots: /tmp empty, answering
    again, sshd (and SLURM's daemons) up."""
    tmp = sandbox.node_dir(node) / "tmp"
    shutil.rmtree(tmp)
    tmp.mkdir()
    tmp.chmod(0o1777)
    faults.booted(sandbox, node)
    unsilence(node)
    start_node(sandbox, node)
    wait_ready(sandbox, [node])
    faults.restore(sandbox, node)
    state = _read_state(sandbox.root) or {}
    if state.get("slurm"):
        slurm_cluster.start_daemons(sandbox, node)
        slurm_cluster.wait_idle(sandbox, [node])
    # Last, so that SLURM's daemons (entered from outside, not the sshd's children) go in too.
    node_cpu.restore(sandbox, node)
