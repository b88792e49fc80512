"""meshkit: make a set of SSH-reachable Linux machines a multi-node PyTorch cluster.

The package root stays light: ``meshkit env``/``run`` import only the pure core and netifaces.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from .distenv import NodeEnv


def discover(hostfile: str | None = "hostfile", **kwargs: Any) -> NodeEnv:
    """This node's place in the job (see ``meshkit.discovery.discover``)."""
    from .discovery import discover as _discover

    return _discover(hostfile, **kwargs)


__all__ = ["__version__", "discover"]
