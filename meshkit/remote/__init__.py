"""SSH to the nodes, and the only place meshkit imports paramiko or fabric.

- ``connection``: one node's single connection, its strict host-key policy, the node shell;
- ``group``: the connections to every node, opened in parallel and reused by every phase, with a
  result per host that keeps the exception (``fan_out``, ``Cluster``);
- ``describe``: one line per failure, naming the node's problem and the fix;
- ``agent``: the client of the node agent (``python -m meshkit.node serve``);
- ``hostkeys``: the host keys a node's sshd serves, proven.
"""

from __future__ import annotations

from .agent import AgentPool
from .connection import Remote, Settings, ssh_config
from .group import Cluster, Outcome, PhaseEvent, ProgressFn, failed, succeeded

__all__ = ["AgentPool", "Cluster", "Outcome", "PhaseEvent", "ProgressFn", "Remote", "Settings"]
__all__ += ["failed", "ssh_config", "succeeded"]
