"""SSH to the nodes, and the only place meshkit imports paramiko or fabric.

- ``connection``: one node's single connection, its strict host-key policy, atomic SFTP writes;
- ``group``: the connections to every node, opened in parallel and reused by every phase, with a
  result per host that keeps the exception (``fan_out``, ``Cluster``);
- ``describe``: one line per failure, naming the node's problem and the fix;
- ``agent``: the client of the node agent (``python -m meshkit.node serve``).
"""

from __future__ import annotations

from .agent import Agent, AgentPool
from .connection import Remote, Settings, StrictPolicy, UnknownHostKey, fingerprint, ssh_config
from .group import Cluster, Outcome, PhaseEvent, ProgressFn, failed, fan_out, succeeded

__all__ = [
    "Agent",
    "AgentPool",
    "Cluster",
    "Outcome",
    "PhaseEvent",
    "ProgressFn",
    "Remote",
    "Settings",
    "StrictPolicy",
    "UnknownHostKey",
    "failed",
    "fan_out",
    "fingerprint",
    "ssh_config",
    "succeeded",
]
