"""This node's health (``meshkit.health``): the readers of each source. (Foundation stub: the
readers land with issue 44's health part.)"""

from __future__ import annotations

from ..health import NodeHealth, judge
from ..protocol import HealthReply, HealthRequest


def read_health(request: HealthRequest) -> NodeHealth:
    """This node's health for ``request`` (its job's workdir, the GPUs expected, the limits)."""
    return judge([], [])


def health(request: HealthRequest) -> HealthReply:
    """The ``health`` op."""
    return HealthReply(read_health(request))
