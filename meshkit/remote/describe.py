"""One line per failure: what went wrong with a node and how to fix it."""

from __future__ import annotations

import errno
import socket

import paramiko
from invoke.exceptions import CommandTimedOut

from ..errors import MeshkitError
from ..hostfile import Host
from .connection import GatewayError, Settings, UnknownHostKey, fingerprint


def describe(exc: BaseException, host: Host, settings: Settings) -> str:
    """One line: what went wrong with this node and how to fix it."""
    port = host.port or settings.port or 22
    if isinstance(exc, UnknownHostKey) and exc.revoked:
        return (
            f"host key of {exc.hostname} is REVOKED (@revoked in known_hosts): {exc.kind} "
            f"{exc.fingerprint}; refused"
        )
    if isinstance(exc, UnknownHostKey):
        return (
            f"unknown host key {exc.kind} {exc.fingerprint}; verify it (ssh-keygen -lf on the "
            "node), then rerun with --accept-new-host-keys"
        )
    if isinstance(exc, GatewayError):
        return f"ProxyJump gateway {exc.hop}: " + describe(exc.cause, Host(exc.hop), settings)
    if isinstance(exc, paramiko.BadHostKeyException):
        expected = fingerprint(exc.expected_key)
        got = fingerprint(exc.key)
        return (
            f"HOST KEY CHANGED: expected {expected}, got {got}; refused. If the node was "
            f"reinstalled, remove the old key: ssh-keygen -R {host.known_hosts_name()}"
        )
    if isinstance(exc, paramiko.AuthenticationException):
        return "authentication failed: pass --identity KEY (a key the node accepts) or --password"
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return (
            f"no answer within {settings.connect_timeout:.0f}s on port {port}: is the node up and "
            "reachable?"
        )
    if isinstance(exc, CommandTimedOut):
        return f"a remote command took longer than {exc.timeout}s; the node may be overloaded"
    if _unreachable(exc):
        return f"no route to host on port {port}: is the node up and reachable?"
    if isinstance(exc, (paramiko.ssh_exception.NoValidConnectionsError, ConnectionRefusedError)):
        return f"connection refused on port {port}: is sshd running?"
    if isinstance(exc, socket.gaierror):
        return f"cannot resolve {host.host}: check the name or use an address"
    if isinstance(exc, MeshkitError):
        return str(exc)
    if isinstance(exc, (paramiko.SSHException, OSError, EOFError)):
        return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    # Still one host's result: a surprise on one node must not hide what happened on the others.
    return f"unexpected {type(exc).__name__}: {exc}"


UNREACHABLE = (errno.EHOSTUNREACH, errno.ENETUNREACH)


def _unreachable(exc: BaseException) -> bool:
    """Whether no route led to the node: a machine that is off, once its neighbours have
    forgotten its link address, or a network down. paramiko reports that as it reports a
    refusal (NoValidConnectionsError), but no sshd was reached to refuse anything."""
    if isinstance(exc, paramiko.ssh_exception.NoValidConnectionsError):
        errors = list(exc.errors.values())
        return bool(errors) and all(_unreachable(error) for error in errors)
    return isinstance(exc, OSError) and exc.errno in UNREACHABLE
