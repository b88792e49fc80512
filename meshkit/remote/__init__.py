"""SSH to the nodes, and the only place meshkit imports paramiko or fabric.

- ``connection``: one node's single connection and its strict host-key policy (``Remote``);
- ``node_shell``: the one shell per node that mesh and unmesh work through (``NodeShell``);
- ``group``: the connections to every node, opened in parallel and reused by every phase, with a
  result per host that keeps the exception (``fan_out``, ``SshGroup``);
- ``describe``: one line per failure, naming the node's problem and the fix;
- ``agent``: the client of the node agent (``python -m meshkit.node serve``);
- ``hostkeys``: the host keys a node's sshd serves, proven.

Each node's result and a phase's progress (``Outcome``, ``PhaseEvent``) are ``meshkit.outcome``'s:
the layers above use them without importing SSH.
"""

from __future__ import annotations

from .agent import AgentPool
from .connection import Remote, Settings, ssh_config
from .group import SshGroup

__all__ = ["AgentPool", "Remote", "Settings", "SshGroup", "ssh_config"]
