"""The ``ports`` op: which TCP ports a job's rendezvous could listen on here, for the launch's
preflight. Standard library only."""

from __future__ import annotations

import errno
import socket

from ..protocol import PortsReply, PortsRequest, PortState
from . import files, jobs

MAX_PORTS = 256  # asked about in one request; the rest are not looked at


def ports(request: PortsRequest) -> PortsReply:
    files.check_dir(files.job_dir(request.job_id))
    states = [PortState(port, port_free(port)) for port in request.ports[:MAX_PORTS]]
    ours = jobs.keeper_pid(request.job_id) is not None
    return PortsReply(states, ours)


def port_free(port: int) -> bool:
    """Whether a TCP listener could bind ``port`` here (as torchrun's store will)."""
    for family, address in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.bind((address, port))
            return True
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return False
    return True
