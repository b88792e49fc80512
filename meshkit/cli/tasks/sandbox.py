"""``sandbox.*`` tasks: a local cluster of real sshd nodes (see meshkit.sandbox)."""

from __future__ import annotations

import json as jsonlib
import math
import sys
import time
from dataclasses import asdict
from typing import TYPE_CHECKING

from invoke.collection import Collection
from invoke.context import Context

from ...errors import UsageError
from ..common import conf, rate, reported, table, task

if TYPE_CHECKING:  # every command builds the task list; only the sandbox's tasks load the sandbox
    from ...sandbox import Layout

DIR_HELP = "sandbox state directory (default: config meshkit.sandbox.dir, /var/tmp/meshkit-sandbox)"
NAME_HELP = "sandbox name, so that several run side by side (default: 'default')"
WHERE = {"dir": DIR_HELP, "name": NAME_HELP}


def _dir(flag: str | None, name: str | None) -> str:
    from ... import sandbox

    return flag or sandbox.default_dir(str(conf().sandbox.dir), name or sandbox.DEFAULT)


def _load(dir: str | None, name: str | None) -> Layout:
    """The running sandbox, after the preflight (root, the system programs)."""
    from ... import sandbox

    sandbox.preflight()
    return sandbox.load(_dir(dir, name))


@task(
    help={
        "nodes": "how many nodes (default: config meshkit.sandbox.nodes, 3)",
        **WHERE,
        "subnet": "private IPv4 subnet for the nodes (default: meshkit.sandbox.subnet,"
        " 10.77.0.0/24, for the default sandbox; for the others a /24 of 10.77.0.0/16 that no"
        " route or address here uses, picked at up)",
        "slurm": "also run a private SLURM cluster on the nodes (slurmctld, one slurmd per node,"
        " munge; Debian slurm-wlm and munge)",
        "networks": "real-world networks, comma list of: second (a second network per node),"
        " ifnames (interface names differ between nodes), docker0 (the same docker0 address in"
        " every node), debian-hosts (the '127.0.1.1 <hostname>' line); or 'all'",
        "user": "also an ordinary user, meshkit-user (created here if absent), with a"
        " home of its own on every node",
    }
)
def up(
    c: Context,
    nodes: int | None = None,
    dir: str | None = None,
    subnet: str | None = None,
    name: str | None = None,
    slurm: bool = False,
    networks: str | None = None,
    user: bool = False,
) -> None:
    """Create a local cluster of N real sshd nodes (root only); replaces a stale one."""
    from ... import sandbox

    with reported():
        started = time.monotonic()
        label = sandbox.check_name(name or sandbox.DEFAULT)
        configured = conf().sandbox
        chosen_subnet = subnet or sandbox.default_subnet(str(configured.subnet), label)
        options = sandbox.NetworkOptions.parse(networks or "")
        count = int(nodes or configured.nodes)
        where = _dir(dir, label)
        created = sandbox.up(where, chosen_subnet, count, label, options, slurm, user=user)
        took = time.monotonic() - started
    rows = [(node.name, node.address, node.netns) for node in created.nodes]
    print(table(["node", "address", "netns"], rows))
    controller = f"controller {created.controller_address} on {created.bridge}"
    print(f"\n{created.count} nodes up in {took:.1f}s ({controller})")
    print(f"hostfile:    {created.hostfile}")
    print(f"ssh config:  {created.ssh_config}   (ssh -F {created.ssh_config} node0)")
    print(f"shared dir:  {created.shared}   (every node sees it: put job workdirs here)")
    if created.networks.any:
        print(f"networks:    {created.networks.describe()}")
    print(f"next:        meshkit mesh --hostfile {created.hostfile}")
    if user:
        print(f"user:        {sandbox.USER}, its files in {created.user_dir}")
        print(f"             (as it: meshkit mesh --hostfile {created.user_hostfile})")
    if slurm:
        from ...sandbox.slurm import conf_path as slurm_conf_path

        env = f"SLURM_CONF={slurm_conf_path(created)}"
        print(f"slurm:       export {env}   (in a node: nsenter or ssh, then srun/sbatch)")
        print(f"             e.g. {env} srun -N{created.count} {sys.executable} -m meshkit env")


@task(help=WHERE)
def down(c: Context, dir: str | None = None, name: str | None = None) -> None:
    """Remove the sandbox: its processes, namespaces, bridge and files (safe to repeat)."""
    from ... import sandbox

    with reported():
        sandbox.preflight()
        removed = sandbox.down(_dir(dir, name), name or sandbox.DEFAULT)
    if removed:
        print(f"removed: {', '.join(removed)}")
    else:
        print("no sandbox to remove")


def _index(node: object, flag: str = "--node") -> int:
    """A node's index as given: a task's required flag has a default of None, or invoke would
    take it as positional and read ``-h`` as its value instead of asking for help."""
    given = str(node)
    if node is None or not (given.isascii() and given.isdigit()):
        raise UsageError(f"give the node by index: {flag} I (e.g. {flag} 1)")
    return int(given)


@task(help={"node": "index of the node to reboot (0 = node0)", **WHERE})
def reboot(
    c: Context, node: int | None = None, dir: str | None = None, name: str | None = None
) -> None:
    """Reboot one node: kill all its processes, empty its /tmp, start its sshd again."""
    from ... import sandbox

    with reported():
        index = _index(node)
        rebooted = sandbox.reboot(_load(dir, name), index)
    print(f"{rebooted.name} ({rebooted.address}) rebooted: processes killed, /tmp emptied, sshd up")


@task(help={"node": "index of the node to switch off (0 = node0)", **WHERE})
def poweroff(
    c: Context, node: int | None = None, dir: str | None = None, name: str | None = None
) -> None:
    """Switch one node off: kill all its processes, keep its sshd down and let connections to it
    time out, until sandbox.poweron (safe to repeat)."""
    from ... import sandbox

    with reported():
        index = _index(node)
        off = sandbox.poweroff(_load(dir, name), index)
    undo = f"meshkit sandbox.poweron --node {node}"
    print(f"{off.name} ({off.address}) powered off: processes killed, no answer (undo: {undo})")


@task(help={"node": "index of the node to switch on (0 = node0)", **WHERE})
def poweron(
    c: Context, node: int | None = None, dir: str | None = None, name: str | None = None
) -> None:
    """Switch a powered-off node on: it boots as after sandbox.reboot (/tmp emptied, sshd up); a
    node that is on is left as it is."""
    from ... import sandbox

    with reported():
        index = _index(node)
        lay = _load(dir, name)
        was_off = sandbox.powered_off(lay, index)
        on = sandbox.poweron(lay, index)
    if was_off:
        print(f"{on.name} ({on.address}) powered on: /tmp emptied, sshd up")
    else:
        print(f"{on.name} ({on.address}) is on already: left as it is")


FAULT_HELP = {
    "node": "index of the node (0 = node0)",
    "xid": "an NVIDIA XID N in the node's kernel log (79: GPU has fallen off the bus)",
    "pci": "the XID's GPU, as the kernel names it (default: GPU 0's, 0000:18:00)",
    "oom": "an out-of-memory kill in the node's kernel log",
    "pid": "the process the XID or OOM kill names (default: 4242)",
    "gpus": "give the node N GPUs through its own nvidia-smi (fewer later: GPUs lost)",
    "ecc": "N uncorrected ECC errors on GPU 0",
    "ib_down": "its InfiniBand port down",
    "ib_errors": "add N to every error counter of its InfiniBand port",
    "disk_full": "the node's file system at PATH (a directory) full: about 1 MiB free",
    "clear": "the node well again: empty kernel log, no GPUs, no InfiniBand, disks freed",
    "json": "print the node's faults as JSON",
    **WHERE,
}


def _count(value: object, flag: str) -> int | None:
    if value is None:
        return None
    given = str(value)
    if not (given.isascii() and given.isdigit()):
        raise UsageError(f"{flag} {given}: give a number, 0 or more")
    return int(given)


@task(help=FAULT_HELP)
def fault(
    c: Context,
    node: int | None = None,
    xid: int | None = None,
    pci: str | None = None,
    oom: bool = False,
    pid: int | None = None,
    gpus: int | None = None,
    ecc: int | None = None,
    ib_down: bool = False,
    ib_errors: int | None = None,
    disk_full: str | None = None,
    clear: bool = False,
    json: bool = False,
    dir: str | None = None,
    name: str | None = None,
) -> None:
    """Make one node unhealthy through its own sources (its /dev/kmsg, nvidia-smi,
    /sys/class/infiniband, a full disk), or well again with --clear; a reboot empties its
    kernel log and keeps the rest."""
    from ... import sandbox

    with reported():
        index = _index(node)
        counts = {
            flag: _count(value, flag)
            for flag, value in (
                ("--xid", xid),
                ("--gpus", gpus),
                ("--ecc", ecc),
                ("--ib-errors", ib_errors),
                ("--pid", pid),
            )
        }
        asked = [counts["--xid"], counts["--gpus"], counts["--ecc"], counts["--ib-errors"]]
        if all(value is None for value in asked) and not (oom or ib_down or disk_full or clear):
            raise UsageError(
                "say what to do to the node: --xid N, --oom, --gpus N, --ecc N, --ib-down, "
                "--ib-errors N, --disk-full PATH or --clear"
            )
        if pci is not None and xid is None:
            raise UsageError("--pci names the GPU of an XID: give --xid N too")
        state = sandbox.fault(
            _load(dir, name),
            index,
            clear=clear,
            gpus=counts["--gpus"],
            ecc=counts["--ecc"],
            xid=counts["--xid"],
            pci=pci,
            oom=oom,
            pid=counts["--pid"] or sandbox.faults.DEFAULT_PID,
            ib_down=ib_down,
            ib_errors=counts["--ib-errors"],
            disk_full=disk_full,
        )
    if json:
        print(jsonlib.dumps(state.as_json()))
        return
    gpu_text = "none" if state.gpus is None else f"{state.gpus} (GPU 0: {state.ecc} ECC errors)"
    ib_text = state.ib_state or "none"
    if state.ib_state:
        errors = max(state.ib_counters.values(), default=0)
        ib_text = f"{state.ib_state}, {errors} errors on each counter"
    print(f"{state.node}: GPUs {gpu_text}; InfiniBand {ib_text}")
    print(f"  full disks: {', '.join(state.disk_full) or 'none'}")
    print(f"  kernel log: {len(state.kernel_log)} records")
    for line in state.kernel_log[-3:]:
        print(f"    {line}")
    print(f"undo: meshkit sandbox.fault --node {index} --clear")


@task(help={**WHERE, "json": "print JSON"})
def status(c: Context, dir: str | None = None, name: str | None = None, json: bool = False) -> None:
    """Show the sandbox nodes: address, power, sshd up, process count."""
    from ... import sandbox

    with reported():
        states = sandbox.status(_load(dir, name))
    if json:
        print(jsonlib.dumps([asdict(state) for state in states]))
        return
    rows = []
    for state in states:
        sshd = "up" if state.sshd else "down"
        rows.append((state.node, state.address, state.power, sshd, state.processes))
    print(table(["node", "address", "power", "sshd", "processes"], rows))


PAIR_HELP = {"node": "index of one node (0 = node0)", "peer": "index of the other node", **WHERE}


def _pair(node: object, peer: object) -> tuple[int, int]:
    given = [str(value) for value in (node, peer) if value is not None]
    all_indices = all(value.isascii() and value.isdigit() for value in given)
    if len(given) < 2 or not all_indices:
        raise UsageError("give both nodes by index: --node I --peer J (e.g. --node 0 --peer 2)")
    return int(given[0]), int(given[1])


@task(help=PAIR_HELP)
def cut(
    c: Context,
    node: int | None = None,
    peer: int | None = None,
    dir: str | None = None,
    name: str | None = None,
) -> None:
    """Cut the link between two nodes, both ways, on every network (undo with sandbox.mend)."""
    from ... import sandbox

    with reported():
        pair = _pair(node, peer)
        sandbox.cut(_load(dir, name), *pair)
    undo = f"meshkit sandbox.mend --node {node} --peer {peer}"
    print(f"cut: node{node} <-> node{peer} (no route between them; undo: {undo})")


@task(help=PAIR_HELP)
def mend(c: Context, node: int, peer: int, dir: str | None = None, name: str | None = None) -> None:
    """Restore the link between two nodes that sandbox.cut took down."""
    from ... import sandbox

    with reported():
        pair = _pair(node, peer)
        sandbox.mend(_load(dir, name), *pair)
    print(f"mended: node{node} <-> node{peer}")


@task(
    help={
        **PAIR_HELP,
        "peer": "the other node: slow only this link (default: all of the node's traffic)",
        "rate": "the rate, e.g. 20Mbit, 1G",
    }
)
def shape(
    c: Context,
    node: int | None = None,
    peer: int | None = None,
    rate_: str | None = None,
    dir: str | None = None,
    name: str | None = None,
) -> None:
    """Slow a link both ways (--peer), or a node's whole interface, with tc (undo:
    sandbox.unshape)."""
    from ... import sandbox

    with reported():
        # Without --peer the node's whole interface is slowed; its index is still checked.
        if peer is None:
            index = _pair(node, 0)[0]
            shaped_peer = None
        else:
            index, shaped_peer = _pair(node, peer)
        bits = int(rate(rate_ or "", "--rate"))
        sandbox.shape(_load(dir, name), index, shaped_peer, bits)
    what = f"node{node} (all its traffic)"
    if peer is not None:
        what = f"node{node} <-> node{peer}"
    print(f"shaped: {what} at {rate_} (undo: meshkit sandbox.unshape)")


@task(help=WHERE)
def unshape(c: Context, dir: str | None = None, name: str | None = None) -> None:
    """Remove every link and node slowing of sandbox.shape."""
    from ... import sandbox

    with reported():
        sandbox.unshape(_load(dir, name))
    print("unshaped: every link at full speed")


def _fraction(value: object) -> float:
    """``--cpu`` as given: a share of the node's CPU, above 0."""
    if value is None:
        raise UsageError(
            "give the share of its CPU the node keeps: --cpu FRACTION (e.g. --cpu 0.33; "
            "--cpu 1 lifts the cap)"
        )
    given = str(value)
    try:
        fraction = float(given)
    except ValueError:
        fraction = math.nan
    if not math.isfinite(fraction) or fraction <= 0:
        raise UsageError(f"--cpu {given[:40]!r}: give a share of the node's CPU above 0, e.g. 0.33")
    return fraction


@task(
    help={
        "node": "index of the node (0 = node0)",
        "cpu": "the share of its own CPU (this machine's CPUs over the sandbox's nodes) the "
        "node's processes together may use, e.g. 0.33 (a third); 1 or more lifts the cap",
        **WHERE,
    }
)
def slow(
    c: Context,
    node: int | None = None,
    cpu: str | None = None,
    dir: str | None = None,
    name: str | None = None,
) -> None:
    """Slow one node: cap its CPU (a cgroup of its own; a reboot keeps it); --cpu 1 lifts the
    cap."""
    from ... import sandbox

    with reported():
        index = _index(node)
        fraction = _fraction(cpu)
        cap = sandbox.slow(_load(dir, name), index, fraction)
    if cap.cpu is None:
        print(f"{cap.node}: CPU cap lifted")
        return
    print(
        f"{cap.node}: CPU capped at {cap.cpu:g} of its own ({cap.processes} processes in "
        f"{cap.group}; later ones inherit it)"
    )
    print(f"undo: meshkit sandbox.slow --node {index} --cpu 1")


ns = Collection(
    "sandbox", up, down, reboot, poweroff, poweron, fault, status, cut, mend, shape, unshape, slow
)
