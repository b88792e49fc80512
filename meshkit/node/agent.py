"""The node agent: ``python -m meshkit.node serve`` answers one request per line until its stdin
closes, so a whole command (preflight and start, or status, or stop) costs one remote exec per
node. Requests are data (JSON, checked against the protocol's types), never shell.
"""

from __future__ import annotations

import importlib
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from ..protocol import (
    MAX_LINE,
    EnvReply,
    EnvRequest,
    PortsReply,
    PortsRequest,
    PortState,
    ProtocolViolation,
    Reply,
    decode_request,
    encode_reply,
)
from . import jobs

ENV_TIMEOUT = 60.0


def env(request: EnvRequest) -> EnvReply:
    """``meshkit env --json ...`` in the job's workdir, as a login there would run it."""
    if not Path(request.cwd).is_dir():
        return EnvReply(1, "", f"cd: {request.cwd}: No such file or directory")
    try:
        done = subprocess.run(
            request.argv,
            cwd=request.cwd,
            capture_output=True,
            text=True,
            timeout=ENV_TIMEOUT,
            check=False,
        )
    except FileNotFoundError:
        return EnvReply(127, "", f"{request.argv[0]}: No such file or directory")
    except subprocess.TimeoutExpired:
        return EnvReply(124, "", f"meshkit env took longer than {ENV_TIMEOUT:.0f}s")
    return EnvReply(done.returncode, done.stdout[-65536:], done.stderr[-65536:])


def ports(request: PortsRequest) -> PortsReply:
    states = [PortState(p, jobs.port_free(p)) for p in request.ports[:256]]
    return PortsReply(states, jobs.keeper_pid(request.job_id) is not None)


# op -> (module of meshkit.node, function). Modules are imported on first use: every node pays
# the agent's start-up at every command, and a status round needs none of doctor, sync or supervise.
HANDLERS: dict[str, tuple[str, str]] = {
    "env": ("agent", "env"),
    "ports": ("agent", "ports"),
    "start": ("jobs", "start"),
    "jobs": ("jobs", "jobs_request"),
    "status": ("jobs", "status"),
    "stop": ("jobs", "stop"),
    "logs": ("jobs", "logs"),
    "doctor_facts": ("doctor", "facts"),
    "doctor_listen": ("doctor", "listen"),
    "doctor_connect": ("doctor", "connect"),
    "doctor_done": ("doctor", "done"),
    "doctor_probe": ("doctor", "probe"),
    "unsupervise": ("supervise", "unsupervise"),
    "manifest": ("sync", "manifest"),
    "put": ("sync", "put"),
}


def handler(op: str) -> Callable[[Any], Reply]:
    module, name = HANDLERS[op]
    found: Callable[[Any], Reply] = getattr(importlib.import_module(f"meshkit.node.{module}"), name)
    return found


def serve(requests: IO[str], replies: IO[str]) -> None:
    while True:
        line = requests.readline(MAX_LINE + 2)
        if not line:
            return
        try:
            if not line.endswith("\n"):
                raise ProtocolViolation(f"request longer than {MAX_LINE} bytes")
            op, request = decode_request(line)
            out = encode_reply(handler(op)(request))
        except Exception as exc:  # one request failed; say so and keep serving
            out = encode_reply(None, f"{type(exc).__name__}: {exc}")
        replies.write(out)
        replies.flush()
