"""meshkit: make a set of SSH-reachable Linux machines a multi-node PyTorch cluster.

The package root stays light: ``meshkit env``/``run`` import only the pure core and netifaces.
"""

from __future__ import annotations

# `typing` costs every `meshkit env` on every node ~15 ms to import; annotations need it only
# for the type checker (mypy honours a module-level TYPE_CHECKING = False).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from .api import Cluster
    from .distenv import NodeEnv

__version__ = "0.1.0"


def discover(hostfile: str | None = "hostfile", **kwargs: Any) -> NodeEnv:
    """This node's place in the job (see ``meshkit.discovery.discover``)."""
    from .discovery import discover as _discover

    return _discover(hostfile, **kwargs)


def __getattr__(name: str) -> type[Cluster]:
    """``meshkit.Cluster``, imported on first use: ``meshkit env`` never imports SSH."""
    if name == "Cluster":
        from .api import Cluster

        return Cluster
    raise AttributeError(f"module 'meshkit' has no attribute {name!r}")


__all__ = ["Cluster", "__version__", "discover"]
