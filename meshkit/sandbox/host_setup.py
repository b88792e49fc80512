"""What the sandbox needs of this machine: root and the system programs, a subnet that clashes
with no route here, room in the kernel's neighbour table, and the namespaces, bridges and links
that make up the sandbox's networks."""

from __future__ import annotations

import fcntl
import ipaddress
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from ..errors import SandboxError
from . import networks as netopts
from .layout import Layout, auto_choices
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
    for route in routes(addresses=False):
        for network in networks:
            if route.device == network.bridge:
                continue
            if route.network.overlaps(network.subnet):
                raise SandboxError(
                    f"{network.what} {network.subnet} overlaps route {route.destination} on "
                    f"{route.device}; {network.fix}"
                )


@dataclass(frozen=True)
class Route:
    """An IPv4 route of this machine (an address, too, with ``addresses``)."""

    network: ipaddress.IPv4Network
    destination: str
    device: str


def routes(addresses: bool) -> list[Route]:
    """This machine's IPv4 routes in every table, the default routes left out; with
    ``addresses``, the local routes of its own addresses too."""
    shown = _run(["ip", "-j", "route", "show", "table", "all"]).stdout or "[]"
    found = []
    for route in json.loads(shown):
        destination = str(route.get("dst", ""))
        if destination in ("", "default"):
            continue
        kind = route.get("type")
        if kind in ("broadcast", "multicast") or (kind == "local" and not addresses):
            continue
        try:
            network = ipaddress.ip_network(destination, strict=False)
        except ValueError:
            continue
        if isinstance(network, ipaddress.IPv4Network):
            found.append(Route(network, destination, str(route.get("dev", ""))))
    return found


def with_free_subnet(sandbox: Layout) -> Layout:
    """``sandbox`` on the first of its name's automatic subnets (layout.auto_choices) that no
    route or address of this machine overlaps, other than on its own bridges; with a second
    network, that one's subnet free too. Call it under ``subnet_lock``."""
    own = (sandbox.bridge, sandbox.second_bridge)
    used = [route.network for route in routes(addresses=True) if route.device not in own]
    chosen = free_subnet(auto_choices(sandbox.name), used, sandbox.networks.second)
    return replace(sandbox, subnet=chosen)


def free_subnet(
    choices: list[ipaddress.IPv4Network], used: list[ipaddress.IPv4Network], second: bool
) -> ipaddress.IPv4Network:
    """The first of ``choices`` that overlaps none of ``used`` (nor does its second network's
    subnet, with ``second``)."""
    for choice in choices:
        wanted = [choice]
        if second:
            wanted.append(netopts.second_network(choice))
        if not any(network.overlaps(taken) for network in wanted for taken in used):
            return choice
    first = choices[0] if choices else "none"
    raise SandboxError(
        f"no free sandbox subnet: every /24 from {first} on overlaps a route or address here; "
        "remove sandboxes no longer used (meshkit sandbox.down --name NAME) or choose --subnet"
    )


# Root's own directory (not a world-writable one): nobody else can hold the lock or plant a link.
SUBNET_LOCK = Path("/run/meshkit-sandbox-subnet.lock")


@contextmanager
def subnet_lock(path: Path = SUBNET_LOCK) -> Iterator[None]:
    """Held from checking or picking a subnet until the sandbox's bridges have their addresses:
    two sandboxes coming up at once then never pick the same free subnet."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    descriptor = os.open(path, flags, 0o600)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        yield
    finally:
        os.close(descriptor)


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
