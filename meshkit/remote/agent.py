"""The client of the node agent (``python -m meshkit.node serve``) over one exec channel."""

from __future__ import annotations

import contextlib
import json
import shlex
import socket
from typing import Any

from ..errors import AgentGone, RemoteError
from .connection import Remote


class Agent:
    """A node-side ``meshkit.node serve`` over one exec channel: several requests, one shell start.
    Requests and replies are JSON lines on the channel's stdin/stdout."""

    def __init__(self, remote: Remote, python: str) -> None:
        self.remote = remote
        transport = remote.conn.client.get_transport()
        self.channel = transport.open_session(timeout=remote.settings.connect_timeout)
        self.channel.settimeout(remote.settings.command_timeout)
        self.channel.exec_command(shlex.join([python, "-m", "meshkit.node", "serve"]))
        self._out = self.channel.makefile("r")
        self._in = self.channel.makefile_stdin("w")

    def call(self, op: str, **args: Any) -> Any:
        """One request's result; RemoteError when the node says it failed or the agent is gone."""
        try:
            self._in.write(json.dumps({"op": op, "args": args}) + "\n")
            self._in.flush()
            line = self._out.readline()
        except (socket.timeout, TimeoutError):
            raise RemoteError(
                f"the node agent did not answer {op!r} within "
                f"{self.remote.settings.command_timeout:.0f}s"
            ) from None
        if not line:
            err = self.channel.makefile_stderr("r").read().strip()
            raise AgentGone(
                self.channel.recv_exit_status(), err.decode() if isinstance(err, bytes) else err
            )
        reply = json.loads(line)
        if not reply["ok"]:
            raise RemoteError(f"{op} failed on the node: {reply['error']}")
        return reply["result"]

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.channel.shutdown_write()
            self.channel.close()
