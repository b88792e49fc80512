"""Which hostfile line is this node, who is master, which port: pure functions of their inputs.

Every node evaluates these with the same hostfile and gets the same answers with no communication.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Sequence

from .digest import sha256
from .errors import TopologyError
from .hostfile import Host
from .record import record

# Interfaces that exist identically on many machines (container bridges, veth ends): an address on
# one of these says nothing about which machine this is, so it never decides a rank.
BRIDGES = ("docker", "br-", "virbr", "lxcbr", "podman", "cni")
SHARED_INTERFACE_PREFIXES = (*BRIDGES, "flannel", "cali", "veth")  # overlays, veth ends too
PORT_RANGE = (20000, 30000)  # below Linux's ephemeral range (32768+), above well-known services


@record
class LocalAddress:
    interface: str
    address: str


@record
class Match:
    rank: int
    address: str
    interface: str

    def describe(self) -> str:
        return f"{self.address} on {self.interface}"


def normalize(address: str) -> str:
    """Canonical text of an address (``fe80::1%eth0`` -> ``fe80::1``); names pass through."""
    try:
        return str(ipaddress.ip_address(address.split("%", 1)[0]))
    except ValueError:
        return address


def _is_local_only(address: str) -> bool:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    return ip.is_loopback or ip.is_link_local or ip.is_unspecified


def usable(local: Sequence[LocalAddress]) -> list[LocalAddress]:
    """The addresses that can tell machines apart."""
    kept = []
    for entry in local:
        if entry.interface.startswith(SHARED_INTERFACE_PREFIXES):
            continue
        address = normalize(entry.address)
        if _is_local_only(address):
            continue
        kept.append(LocalAddress(entry.interface, address))
    return kept


def match_rank(
    hosts: Sequence[Host],
    resolved: Sequence[Sequence[str]],
    local: Sequence[LocalAddress],
    hostname: str,
    path: str = "hostfile",
) -> Match:
    """The one hostfile entry that is this machine: by address, then by hostname, then (a one-line
    hostfile of loopback/localhost) by loopback. ``resolved[i]`` are the addresses of
    ``hosts[i]``."""
    matches = _matches_by_address(resolved, local)
    if not matches:
        matches = _matches_by_hostname(hosts, hostname)
        if not matches and _is_one_local_line(hosts, resolved):
            if resolved[0]:
                return Match(0, normalize(resolved[0][0]), "lo")
            return Match(0, hosts[0].host, "lo")
    if len(matches) == 1:
        return matches[0]
    if matches:
        which = ", ".join(
            f"line {hosts[match.rank].lineno} ({hosts[match.rank].label}) via {match.describe()}"
            for match in matches
        )
        head = (
            f"{path}: this machine ({hostname}) matches {len(matches)} lines: {which}; "
            "list each machine once"
        )
    else:
        head = (
            f"{path}: this machine ({hostname}) matches no line; add one of its addresses to the "
            "hostfile, or set MESHKIT_NODE_RANK / --node-rank"
        )
    ours = ", ".join(f"{entry.interface}={normalize(entry.address)}" for entry in local)
    theirs = ", ".join(
        f"{host.label}={'/'.join(addresses) or 'unresolved'}"
        for host, addresses in zip(hosts, resolved)
    )
    raise TopologyError(
        [head, f"  local addresses: {ours or 'none'}", f"  hostfile addresses: {theirs}"]
    )


def spare_match(
    spares: Sequence[Host],
    resolved: Sequence[Sequence[str]],
    local: Sequence[LocalAddress],
    hostname: str,
) -> Host | None:
    """The spare line that is this machine (by address, then by hostname), if one is."""
    matches = _matches_by_address(resolved, local) or _matches_by_hostname(spares, hostname)
    if not matches:
        return None
    return spares[matches[0].rank]


def _matches_by_address(
    resolved: Sequence[Sequence[str]], local: Sequence[LocalAddress]
) -> list[Match]:
    """Each hostfile line that resolves to one of this machine's usable addresses, with the first
    such address."""
    interface_of = {entry.address: entry.interface for entry in usable(local)}
    first: dict[int, Match] = {}
    for rank, addresses in enumerate(resolved):
        for address in map(normalize, addresses):
            if address in interface_of:
                first.setdefault(rank, Match(rank, address, interface_of[address]))
    return list(first.values())


def _matches_by_hostname(hosts: Sequence[Host], hostname: str) -> list[Match]:
    """The lines that name this machine (its full or its short hostname); addresses never do."""
    names = (hostname.lower(), hostname.split(".", 1)[0].lower())
    matches = []
    for rank, host in enumerate(hosts):
        if not host.is_ip and host.host.lower() in names:
            matches.append(Match(rank, host.host, "hostname"))
    return matches


def _is_one_local_line(hosts: Sequence[Host], resolved: Sequence[Sequence[str]]) -> bool:
    """A one-line hostfile whose every address is this machine's loopback (``localhost``)."""
    if len(hosts) != 1:
        return False
    return all(_is_local_only(normalize(address)) for address in resolved[0])


def derive_master_port(hosts: Sequence[Host], session: str) -> int:
    """A port every node derives identically from the node list and the session name, so that two
    clusters (or two sessions) on the same machines do not collide."""
    nodes = "\n".join(f"{host.user or ''}@{host.host}:{host.port or ''}" for host in hosts)
    canonical = nodes + "\0" + session
    digest = int.from_bytes(sha256(canonical.encode())[:8], "big")
    low, high = PORT_RANGE
    return low + digest % (high - low)


# -- the interface the backends should use (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME) ---------------

SOCKET_IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


@record
class Interface:
    """The interface this node's backends should bind, and why (``name`` None: none found)."""

    name: str | None
    address: str | None
    reason: str


def interface_of_match(match: Match) -> Interface | None:
    """The interface holding the address that placed this node in the hostfile: the network the
    user chose. None when the hostfile matched by hostname (no address, so no interface)."""
    if match.interface == "hostname":
        return None
    why = f"hostfile: {match.address} on {match.interface} placed this node"
    return Interface(match.interface, match.address, why)


def interface_by_route(
    master: str,
    routes: Sequence[tuple[str, str | None]],
    local: Sequence[LocalAddress],
    nnodes: int,
) -> Interface:
    """The interface that reaches MASTER_ADDR. ``routes`` pairs each address ``master`` resolves to
    with the local source address the kernel would send from (None: no route). In a multi-node job
    a loopback answer (``127.0.1.1 <hostname>`` in /etc/hosts) says nothing about the network, so it
    never decides."""
    by_address = {normalize(entry.address): entry.interface for entry in local}
    skipped = []
    for target, source in routes:
        target = normalize(target)
        if source is None:
            skipped.append(f"{target}: no route")
            continue
        source = normalize(source)
        name = by_address.get(source)
        if nnodes > 1 and (_is_local_only(target) or _is_local_only(source)):
            skipped.append(f"{target}: loopback")
            continue
        if name is None:
            skipped.append(f"{target}: source {source} is on no local interface")
            continue
        why = f"route: MASTER_ADDR {master} ({target}) is reached from {source} on {name}"
        return Interface(name, source, why)
    why = "; ".join(skipped) or "it does not resolve"
    return Interface(
        None,
        None,
        f"none: no usable route to MASTER_ADDR {master} ({why}); "
        "set GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME or list addresses in the hostfile",
    )


@record
class SocketIfnames:
    """The socket-interface variables to export, and why they have these values."""

    variables: dict[str, str]
    reason: str


def socket_ifnames(chosen: Interface | None, environ: Mapping[str, str]) -> SocketIfnames:
    """The user's own settings are kept (exported unchanged), the chosen interface fills the
    others."""
    variables: dict[str, str] = {}
    kept = []
    for name in SOCKET_IFNAME_VARIABLES:
        if environ.get(name):
            variables[name] = environ[name]
            kept.append(name)
        elif chosen is not None and chosen.name is not None:
            variables[name] = chosen.name
    reasons = []
    if kept:
        reasons.append(f"{', '.join(kept)} already set: kept")
    if len(kept) < len(SOCKET_IFNAME_VARIABLES):
        if chosen is not None:
            reasons.append(chosen.reason)
        else:
            reasons.append("none: no interface found")
    return SocketIfnames(variables, "; ".join(reasons))
