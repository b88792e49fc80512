"""This node's InfiniBand/RoCE ports as sysfs shows them (``/sys/class/infiniband``): each
port's state, and the error counters health compares with the job's baseline. Standard
library only; the root is a parameter, so tests read a recorded tree.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field

INFINIBAND = "/sys/class/infiniband"
MAX_PORTS = 64
# The counters that rise when a link flaps or corrupts: the job's baseline is their first read.
ERROR_COUNTERS = (
    "link_downed",
    "symbol_error",
    "port_rcv_errors",
    "link_error_recovery",
    "local_link_integrity_errors",
    "excessive_buffer_overrun_errors",
)


@dataclass(frozen=True)
class IbPort:
    """One port (``mlx5_0:1``): its state ("ACTIVE", "DOWN", ...) and error counters."""

    name: str
    state: str
    counters: dict[str, int] = field(default_factory=dict)


def _read(path: str) -> str:
    with open(path) as handle:
        return handle.read(256)


def ports(root: str = INFINIBAND, counters: bool = True) -> list[IbPort]:
    """Each device port under ``root`` (none where there is no such directory)."""
    found = []
    with contextlib.suppress(OSError):
        for device in sorted(os.listdir(root)):
            with contextlib.suppress(OSError):
                for port in sorted(os.listdir(f"{root}/{device}/ports")):
                    where = f"{root}/{device}/ports/{port}"
                    try:
                        state = _read(f"{where}/state").rpartition(":")[2].strip()  # "4: ACTIVE"
                    except OSError:
                        continue
                    values = {}
                    for name in ERROR_COUNTERS if counters else ():
                        with contextlib.suppress(OSError, ValueError):
                            values[name] = int(_read(f"{where}/counters/{name}").strip())
                    found.append(IbPort(f"{device}:{port}", state[:32], values))
    return found[:MAX_PORTS]
