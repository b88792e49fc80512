"""This machine's addresses, names and GPUs: the only netifaces importer. Never imports torch."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from collections.abc import Iterable

import netifaces

from .topology import LocalAddress, normalize

GPU_PROBE_TIMEOUT = 5.0


def local_addresses() -> list[LocalAddress]:
    """Every IPv4 and IPv6 address of every interface."""
    found = []
    for interface in netifaces.interfaces():
        families = netifaces.ifaddresses(interface)
        for family in (netifaces.AF_INET, netifaces.AF_INET6):
            for entry in families.get(family, []):
                if entry.get("addr"):
                    found.append(LocalAddress(interface, normalize(entry["addr"])))
    return found


def resolve(host: str) -> tuple[str, ...]:
    """All addresses a hostfile name resolves to here (an address resolves to itself); empty when the
    name does not resolve, which only matters if nothing else matches."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError):
        return ()
    return tuple(dict.fromkeys(normalize(str(info[4][0])) for info in infos))


def resolve_all(hosts: Iterable[str]) -> dict[str, tuple[str, ...]]:
    return {h: resolve(h) for h in dict.fromkeys(hosts)}


def route_sources(host: str, port: int) -> list[tuple[str, str | None]]:
    """For each address ``host`` resolves to: the local address the kernel would send from (None
    when there is no route). A UDP connect() only looks the route up; it sends nothing."""
    found: list[tuple[str, str | None]] = []
    for address in resolve(host):
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                probe.connect((address, port))
                found.append((address, normalize(str(probe.getsockname()[0]))))
        except OSError:
            found.append((address, None))
    return found


def hostname() -> str:
    return socket.gethostname()


def gpu_count() -> int:
    """GPUs visible to this process, without importing torch: CUDA_VISIBLE_DEVICES when set, else
    the NVIDIA driver's /proc entries, else ``nvidia-smi -L``; 0 when there are none."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        pass
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        out = subprocess.run(
            [smi, "-L"], capture_output=True, text=True, timeout=GPU_PROBE_TIMEOUT, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))
