"""What the sandbox needs of this machine: root and the system programs, a subnet that clashes
with no route here, room in the kernel's neighbour table, and the namespaces, bridges and links
that make up the sandbox's networks."""

from __future__ import annotations

import ipaddress
import json
import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import SandboxError
from . import networks as netopts
from .layout import Layout
from .system import ip_batch, need
from .system import run as _run

PROGRAMS = {
    "sshd": "openssh-server",
    "ssh": "openssh-client",
    "ssh-keygen": "openssh-client",
    "tmux": "tmux",
    "ip": "iproute2",
    "unshare": "util-linux",
    "nsenter": "util-linux",
}


def preflight() -> None:
    """Root and the system programs, with the Debian packages that provide them."""
    if os.geteuid() != 0:
        raise SandboxError(
            "the sandbox needs root (network namespaces, bind mounts, sshd): run with sudo"
        )
    need(PROGRAMS, "missing programs")


@dataclass(frozen=True)
class _Network:
    """One of the sandbox's networks, as ``check_subnet`` names it in a refusal."""

    subnet: ipaddress.IPv4Network
    bridge: str
    what: str
    fix: str


def check_subnet(sandbox: Layout) -> None:
    """Refuse a subnet (and the second network's) that overlaps any route or address of this
    machine other than our own bridges."""
    networks = [
        _Network(
            sandbox.subnet,
            sandbox.bridge,
            "sandbox subnet",
            "choose another with --subnet (config meshkit.sandbox.subnet)",
        )
    ]
    if sandbox.networks.second:
        networks.append(
            _Network(
                netopts.second_subnet(sandbox),
                sandbox.second_bridge,
                "the sandbox's second network",
                "choose another --subnet (it is subnet + 0.1.0.0)",
            )
        )
    shown = _run(["ip", "-j", "route", "show", "table", "all"]).stdout or "[]"
    for route in json.loads(shown):
        destination = str(route.get("dst", ""))
        device = str(route.get("dev", ""))
        if destination in ("", "default"):
            continue
        if route.get("type") in ("local", "broadcast", "multicast"):
            continue
        try:
            other = ipaddress.ip_network(destination, strict=False)
        except ValueError:
            continue
        for network in networks:
            if device == network.bridge or other.version != 4:
                continue
            if other.overlaps(network.subnet):
                raise SandboxError(
                    f"{network.what} {network.subnet} overlaps route {destination} on {device}; "
                    f"{network.fix}"
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
    wanted = {"gc_thresh3": entries, "gc_thresh2": entries // 2}
    changed = []
    for family in ("ipv4", "ipv6"):
        for name, want in wanted.items():
            path = root / family / "neigh" / "default" / name
            try:
                if int(path.read_text().split()[0]) < want:
                    path.write_text(f"{want}\n")
                    changed.append(f"net.{family}.neigh.default.{name}={want}")
            except (OSError, ValueError, IndexError):
                # Not Linux-like, or not allowed: the sandbox still works up to ~32 nodes.
                continue
    return changed


def create_network(sandbox: Layout) -> None:
    """Every node's network namespace, the bridges and links on this machine, and each node's
    side of them."""
    neighbour_room(sandbox.count)
    for node in sandbox.nodes:
        _run(["ip", "netns", "add", node.netns])
    ip_batch(netopts.host_batch(sandbox))
    for node in sandbox.nodes:
        ip_batch(netopts.node_batch(sandbox, node), node.netns)


def netns_names() -> list[str]:
    """Every network namespace on this machine, the sandboxes' and any other."""
    done = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in done.stdout.splitlines() if line.strip()]
