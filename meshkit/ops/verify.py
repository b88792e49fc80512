"""The N x N check of a mesh, run on the nodes themselves: can every node log in to every other
by the names the hostfile uses, with strict host keys? Used by mesh (after installing),
``meshkit check`` and the doctor."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from .. import verifyplan as vp
from ..hostfile import Host
from ..outcome import succeeded
from .pool import NodeConnections

if TYPE_CHECKING:  # importing remote pulls in paramiko: the connections are the caller's
    from ..remote.connection import Remote
    from ..remote.node_shell import NodeShell

HOSTNAME_READ = "head -c 256 /proc/sys/kernel/hostname"


def own_hostname(remote: Remote) -> str:
    """The node's own hostname; '' when it cannot be read (a failure leaves the node out of
    ``each``'s results)."""
    code, out, _ = remote.run(HOSTNAME_READ)
    if code != 0:
        return ""
    return out.strip()


def verify(
    nodes: NodeConnections,
    hosts: Sequence[Host],
    own: dict[Host, str] | None = None,
    shells: dict[Host, NodeShell] | None = None,
) -> vp.VerifyResult:
    """The N x N check, run on the nodes over the controller's existing connections (over their
    node shells when given: no new shell on the source): one full login per ordered pair by the
    hostfile spelling; by each node's own hostname, its host-key check alone (no login)."""
    if own is None:
        own = dict(succeeded(nodes.each("names", own_hostname, hosts, quiet=True)))
    settings = nodes.settings
    # Each node makes its logins VERIFY_BATCH at a time; each batch may take up to connect_timeout:
    # budget the batches on top of the usual command timeout.
    batches = -(-len(vp.targets(hosts, own)) // vp.VERIFY_BATCH)
    timeout = settings.command_timeout + settings.connect_timeout * batches
    rank = {host: index for index, host in enumerate(hosts)}

    def run(remote: Remote) -> str:
        with remote.bounded("verify", timeout):
            script = vp.verify_script(hosts, settings.connect_timeout, rank[remote.host], own)
            shell = (shells or {}).get(remote.host)
            if shell is None:
                _, out, _ = remote.run(script, timeout=timeout)
                return out
            data = script.encode()
            reply = shell.ask((f"sh {len(data)}", data))[0]
            return reply.body.decode(errors="replace")

    results = nodes.each("verify", run, hosts)
    result = vp.VerifyResult(list(hosts))
    for source in hosts:
        outcome = results.get(source)
        if outcome is not None and outcome.value is not None:
            result.failures += vp.parse_verify(source, hosts, outcome.value, own)
            continue
        why = nodes.failures.get(source)
        if not why and outcome is not None:
            why = outcome.error
        cannot = f"controller cannot use {source.label}: {why or 'unreachable'}"
        result.failures += [vp.PairFailure(source, target, cannot) for target in hosts]
    return result
