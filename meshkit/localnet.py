"""This machine's addresses, names and GPUs: the only netifaces importer. Never imports torch."""

from __future__ import annotations

import ipaddress
import os

import netifaces

from .node.gpus import gpu_count as gpu_count  # the GPU count lives with the node side
from .topology import LocalAddress, normalize


def local_addresses() -> list[LocalAddress]:
    """Every IPv4 and IPv6 address of every interface."""
    found = []
    for interface in netifaces.interfaces():
        try:
            families = netifaces.ifaddresses(interface)
        except ValueError:
            # Gone since the listing (a container's veth, a sandbox's): skip it.
            continue
        for family in (netifaces.AF_INET, netifaces.AF_INET6):
            for entry in families.get(family, []):
                if entry.get("addr"):
                    found.append(LocalAddress(interface, normalize(entry["addr"])))
    return found


def resolve(host: str) -> tuple[str, ...]:
    """All addresses a hostfile name resolves to here (an address resolves to itself); empty when
    the name does not resolve, which only matters if nothing else matches."""
    try:
        ipaddress.ip_address(host)
        return (normalize(host),)  # what getaddrinfo answers for an address, without its cost
    except ValueError:
        pass
    # Imported here: a hostfile of addresses (the common case) needs neither socket nor the idna
    # codec it brings, a noticeable part of every `meshkit env` and `meshkit run` on every node.
    import socket

    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError):
        return ()
    return tuple(dict.fromkeys(normalize(str(info[4][0])) for info in infos))


def route_sources(host: str, port: int) -> list[tuple[str, str | None]]:
    """For each address ``host`` resolves to: the local address the kernel would send from (None
    when there is no route). A UDP connect() only looks the route up; it sends nothing."""
    import socket

    found: list[tuple[str, str | None]] = []
    for address in resolve(host):
        family = socket.AF_INET
        if ":" in address:
            family = socket.AF_INET6
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                probe.connect((address, port))
                found.append((address, normalize(str(probe.getsockname()[0]))))
        except OSError:
            found.append((address, None))
    return found


def hostname() -> str:
    return os.uname().nodename  # what socket.gethostname() answers on Linux
