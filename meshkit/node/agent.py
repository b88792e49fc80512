"""The node agent: ``python -m meshkit.node serve`` answers one request per line until its stdin
closes, so a whole command (preflight and start, or status, or stop) costs one remote exec per
node. Requests are data (JSON, checked against the protocol's types), never shell. The agent only
dispatches: each op's handler is named in the protocol's one table (``protocol.OPS``) and
imported at its first request.
"""

from __future__ import annotations

import sys

from .. import protocol
from ..protocol import MAX_LINE

TYPE_CHECKING = False  # no runtime `typing` in the agent (see meshkit/record.py)
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import IO, Any


def handler(op: str) -> Callable[[Any], protocol.Reply]:
    """The function that answers ``op``, which protocol.OPS names ("module.function" of
    meshkit.node)."""
    _, _, where = protocol.OPS[op]
    module, _, name = where.partition(".")
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
            reply = protocol.encode_reply(handler(op)(request))
        except Exception as exc:  # one request failed; say so and keep serving
            reply = protocol.encode_reply(None, f"{type(exc).__name__}: {exc}")
        replies.write(reply)
        replies.flush()
