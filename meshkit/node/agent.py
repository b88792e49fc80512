"""The node agent: ``python -m meshkit.node serve`` answers one request per line until its stdin
closes, so a whole command (preflight and start, or status, or stop) costs one remote exec per
node. Requests are data (JSON, checked against the protocol's types), never shell; each op's
handler is named in the protocol's one table (``protocol.OPS``).
"""

from __future__ import annotations

import os
import sys

from .. import protocol
from ..protocol import MAX_LINE, EnvReply, EnvRequest, PortsReply, PortsRequest, PortState
from ..record import asdict

TYPE_CHECKING = False  # no runtime `typing` in the agent (see meshkit/record.py)
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import IO, Any


def env(request: EnvRequest) -> EnvReply:
    """Rank discovery here, for the job in ``request.cwd``: what ``meshkit run`` will export."""
    from .. import settings
    from ..distenv import variables
    from ..envrun import node_env
    from ..errors import MeshkitError

    if not os.path.isdir(request.cwd):
        why = f"workdir {request.cwd} is missing (it must be on storage every node shares)"
        return EnvReply({}, "", None, "", why)
    flags = {k: None if v is None else str(v) for k, v in asdict(request).items() if k != "cwd"}
    try:
        node = node_env(settings.load(cwd=request.cwd), **flags)
    except MeshkitError as exc:
        return EnvReply({}, "", None, "", str(exc))
    return EnvReply(variables(node), node.source, node.matched, node.interface_source)


def ports(request: PortsRequest) -> PortsReply:
    from . import jobs

    states = [PortState(p, jobs.port_free(p)) for p in request.ports[:256]]
    return PortsReply(states, jobs.keeper_pid(request.job_id) is not None)


def handler(op: str) -> Callable[[Any], protocol.Reply]:
    module, _, name = protocol.OPS[op][2].partition(".")
    full = f"meshkit.node.{module}"
    __import__(full)  # not importlib (and its warnings): one more import at every agent's start
    found: Callable[[Any], protocol.Reply] = getattr(sys.modules[full], name)
    return found


def serve(requests: IO[str], replies: IO[str]) -> None:
    while True:
        line = requests.readline(MAX_LINE + 2)
        if not line:
            return
        try:
            if not line.endswith("\n"):
                raise protocol.ProtocolViolation(f"request longer than {MAX_LINE} bytes")
            op, request = protocol.decode_request(line)
            out = protocol.encode_reply(handler(op)(request))
        except Exception as exc:  # one request failed; say so and keep serving
            out = protocol.encode_reply(None, f"{type(exc).__name__}: {exc}")
        replies.write(out)
        replies.flush()
