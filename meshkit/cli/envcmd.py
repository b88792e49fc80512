"""What ``meshkit env`` and ``meshkit run`` do, shared by the invoke tasks and the fast path.

These run on every node at every launch, so this module imports neither invoke nor anything of SSH.
``conf`` is the checked configuration (``meshkit.settings.Config``); flags win over it.
"""

from __future__ import annotations

import os
import sys

from ..distenv import NodeEnv, as_json, export_lines, log_target, logged, variables
from ..errors import UsageError
from ..node.signals import reset_for_exec
from ..settings import Config

TYPE_CHECKING = False  # no runtime `typing` on the env path (see meshkit/__init__.py)
if TYPE_CHECKING:
    from typing import Any, NoReturn


def pick(conf: Config, name: str, flag: Any) -> Any:
    """A flag when given, else the configured value (flags are the last config level)."""
    return flag if flag is not None else conf.get(name)


def pick_int(conf: Config, name: str, flag: Any, *, allow_auto: bool = False) -> int | None:
    value = pick(conf, name, flag)
    if value is None or value == "" or (allow_auto and str(value) == "auto"):
        return None
    text = str(value)
    if not text.isdigit() or int(text) < 1:
        hint = " or 'auto'" if allow_auto else ""
        raise UsageError(f"--{name.replace('_', '-')} {text!r}: expected a whole number >= 1{hint}")
    return int(text)


def node_env(
    conf: Config,
    *,
    hostfile: str | None = None,
    node_rank: str | None = None,
    session: str | None = None,
    master_port: str | None = None,
    nproc_per_node: str | None = None,
    include: str | None = None,
    exclude: str | None = None,
) -> NodeEnv:
    from ..discovery import discover

    rank = None
    if node_rank is not None:
        if not str(node_rank).isdigit():
            raise UsageError(f"--node-rank {node_rank!r}: expected a whole number >= 0")
        rank = int(node_rank)
    return discover(
        pick(conf, "hostfile", hostfile),
        session=pick(conf, "session", session),
        node_rank=rank,
        master_port=pick_int(conf, "master_port", master_port),
        nproc_per_node=pick_int(conf, "nproc_per_node", nproc_per_node, allow_auto=True),
        include=pick(conf, "include", include),
        exclude=pick(conf, "exclude", exclude),
    )


def print_env(node: NodeEnv, as_json_output: bool) -> None:
    if as_json_output:
        import json  # only for --json

        print(json.dumps(as_json(node)))
    else:
        print(export_lines(node))


def exec_run(node: NodeEnv, cmd: str, log: str | None) -> NoReturn:
    """Replace this process with ``bash -c CMD`` carrying the node's variables."""
    # Nodes share the venv path: make its tools (torchrun) reachable as if it were activated.
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    script = cmd
    if log:
        target = log_target(log, node.node_rank)
        os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
        script = logged(cmd, target)
    sys.stdout.flush()
    reset_for_exec()  # not Python's SIG_IGN for SIGPIPE: `yes | head` in the command must end quietly
    os.execvpe("bash", ["bash", "-c", script], {**os.environ, **variables(node), "PATH": path})
