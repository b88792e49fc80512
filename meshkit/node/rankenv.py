"""The ``env`` op: rank discovery on this node for a job's workdir, as ``meshkit run`` will
do it there (the workdir's meshkit.yaml included), for the launch's preflight. Standard
library only; imported at the first ``env`` request, not at every agent's start."""

from __future__ import annotations

import os

from .. import settings
from ..distenv import variables
from ..envrun import node_env
from ..errors import MeshkitError
from ..protocol import EnvReply, EnvRequest
from ..record import asdict


def env(request: EnvRequest) -> EnvReply:
    """What ``meshkit run`` will export here for the job in ``request.cwd``, or why it
    cannot."""
    if not os.path.isdir(request.cwd):
        why = f"workdir {request.cwd} is missing (it must be on storage every node shares)"
        return EnvReply({}, "", None, "", why)
    # The request's other fields are `meshkit env`'s flags, which arrive as text.
    flags: dict[str, str | None] = {}
    for name, value in asdict(request).items():
        if name == "cwd":
            continue
        if value is None:
            flags[name] = None
        else:
            flags[name] = str(value)
    try:
        node = node_env(settings.load(cwd=request.cwd), **flags)
    except MeshkitError as exc:
        return EnvReply({}, "", None, "", str(exc))
    return EnvReply(variables(node), node.source, node.matched, node.interface_source)
