"""What ``meshkit env`` and ``meshkit run`` do, shared by the invoke tasks and the fast path.

These run on every node at every launch, so this module imports neither invoke nor anything of SSH.
``conf`` is the checked configuration (``meshkit.settings.Config``); flags win over it.
"""

from __future__ import annotations

import os
import sys

from ..distenv import NodeEnv, as_json, export_lines, log_target, logged, rank_variables, variables
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


def _script(node: NodeEnv, cmd: str, log: str | None) -> str:
    if not log:
        return cmd
    target = log_target(log, node.node_rank)
    os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
    return logged(cmd, target)


def _environment(node: NodeEnv) -> dict[str, str]:
    # Nodes share the venv path: make its tools (torchrun) reachable as if it were activated.
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    return {**os.environ, **variables(node), "PATH": path}


def exec_run(node: NodeEnv, cmd: str, log: str | None) -> NoReturn:
    """Replace this process with ``bash -c CMD`` carrying the node's variables."""
    script = _script(node, cmd, log)
    sys.stdout.flush()
    reset_for_exec()  # not Python's SIG_IGN for SIGPIPE: `yes | head` in the command must end quietly
    os.execvpe("bash", ["bash", "-c", script], _environment(node))


SPAWN_LAUNCHERS = ("torch.distributed.run", "torch.distributed.launch")  # as python -m


def check_spawn_cmd(cmd: str) -> None:
    """``--spawn`` starts every rank itself: a launcher in CMD would start NPROC_PER_NODE
    launchers per node, each starting its own ranks, and the job would hang in rendezvous."""
    words = cmd.split()
    for i, word in enumerate(words[:8]):
        if word.rsplit("/", 1)[-1] == "torchrun" or (
            i and words[i - 1] == "-m" and word in SPAWN_LAUNCHERS
        ):
            raise UsageError(
                f"--spawn with {word[:60]!r} in --cmd: --spawn starts the node's ranks itself; run the "
                "script (python train.py), or drop --spawn and let the launcher start them"
            )


def spawn_run(node: NodeEnv, cmd: str, log: str | None) -> NoReturn:
    """NPROC_PER_NODE processes of ``bash -c CMD``, each with the node's variables and torchrun's
    worker variables (RANK, LOCAL_RANK, ...); exit with the first failure's code, else 0."""
    from ..node.ranks import run_ranks

    check_spawn_cmd(cmd)
    script = _script(node, cmd, log)
    base = _environment(node)
    if node.nproc_per_node > 1 and "OMP_NUM_THREADS" not in base:
        base["OMP_NUM_THREADS"] = "1"  # what torchrun sets: N ranks x all cores would oversubscribe
    envs = [{**base, **rank_variables(node, i)} for i in range(node.nproc_per_node)]
    sys.stdout.flush()
    raise SystemExit(run_ranks(script, envs))
