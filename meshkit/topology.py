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
    return [
        LocalAddress(a.interface, normalize(a.address))
        for a in local
        if not a.interface.startswith(SHARED_INTERFACE_PREFIXES)
        and not _is_local_only(normalize(a.address))
    ]


def match_rank(
    hosts: Sequence[Host],
    resolved: Sequence[Sequence[str]],
    local: Sequence[LocalAddress],
    hostname: str,
    path: str = "hostfile",
) -> Match:
    """The one hostfile entry that is this machine: by address, then by hostname, then (a one-line
    hostfile of loopback/localhost) by loopback. ``resolved[i]`` are the addresses of ``hosts[i]``."""
    mine = {a.address: a.interface for a in usable(local)}
    first: dict[int, Match] = {}  # each line's first matching address
    for i, addrs in enumerate(resolved):
        for addr in map(normalize, addrs):
            if addr in mine:
                first.setdefault(i, Match(i, addr, mine[addr]))
    matches = list(first.values())
    if not matches:
        names = (hostname.lower(), hostname.split(".", 1)[0].lower())
        matches = [
            Match(i, h.host, "hostname")
            for i, h in enumerate(hosts)
            if not h.is_ip and h.host.lower() in names
        ]
        one_local = len(hosts) == 1 and all(_is_local_only(normalize(a)) for a in resolved[0])
        if not matches and one_local:
            return Match(0, normalize(resolved[0][0]) if resolved[0] else hosts[0].host, "lo")
    if len(matches) == 1:
        return matches[0]
    if matches:
        which = ", ".join(
            f"line {hosts[m.rank].lineno} ({hosts[m.rank].label}) via {m.describe()}"
            for m in matches
        )
        head = f"{path}: this machine ({hostname}) matches {len(matches)} lines: {which}; list each machine once"
    else:
        head = (
            f"{path}: this machine ({hostname}) matches no line; add one of its addresses to the "
            "hostfile, or set MESHKIT_NODE_RANK / --node-rank"
        )
    ours = ", ".join(f"{a.interface}={normalize(a.address)}" for a in local) or "none"
    theirs = ", ".join(
        f"{h.label}={'/'.join(addrs) or 'unresolved'}" for h, addrs in zip(hosts, resolved)
    )
    raise TopologyError([head, f"  local addresses: {ours}", f"  hostfile addresses: {theirs}"])


def derive_master_port(hosts: Sequence[Host], session: str) -> int:
    """A port every node derives identically from the node list and the session name, so that two
    clusters (or two sessions) on the same machines do not collide."""
    canonical = "\n".join(f"{h.user or ''}@{h.host}:{h.port or ''}" for h in hosts) + "\0" + session
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
    by_address = {normalize(a.address): a.interface for a in local}
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


def socket_ifnames(
    chosen: Interface | None, environ: Mapping[str, str]
) -> tuple[dict[str, str], str]:
    """The socket-interface variables to export and the reason: the user's own settings are kept
    (exported unchanged), the chosen interface fills the others."""
    out: dict[str, str] = {}
    kept = []
    for var in SOCKET_IFNAME_VARIABLES:
        if environ.get(var):
            out[var] = environ[var]
            kept.append(var)
        elif chosen is not None and chosen.name is not None:
            out[var] = chosen.name
    reasons = [f"{', '.join(kept)} already set: kept"] if kept else []
    if len(kept) < len(SOCKET_IFNAME_VARIABLES):
        reasons.append(chosen.reason if chosen is not None else "none: no interface found")
    return out, "; ".join(reasons)
