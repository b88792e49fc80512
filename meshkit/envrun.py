"""``meshkit env`` and ``meshkit run``: discover this node's place, then print it or exec the
command. The one implementation, called by the console script, the invoke tasks and the node side
(the agent answers the controller's env request with ``node_env``; the keeper runs ``main``).

Standard library only, and no invoke: this runs on every node at every launch. Flags are parsed
without argparse (``flagparse``); anything unusual (help, a flag it does not know) goes to the
invoke Program, which reports it as usual. ``conf`` is the checked configuration
(``meshkit.settings.Config``); flags win over it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from .distenv import (
    NodeEnv,
    RankRecording,
    as_json,
    environment,
    export_lines,
    log_target,
    logged,
    rank_variables,
)
from .errors import MeshkitError, UsageError
from .flagparse import Fallback, Flags
from .flagparse import parse as parse_flags
from .node.files import errors_dir
from .node.signals import reset_for_exec
from .settings import Config, load, pick, pick_int, whole

TYPE_CHECKING = False  # no runtime `typing` on the env path (see meshkit/__init__.py)
if TYPE_CHECKING:
    from typing import NoReturn

HOSTFILE_FLAGS = ("hostfile", "include", "exclude")
DISCOVERY_FLAGS = (*HOSTFILE_FLAGS, "node_rank", "session", "master_port", "nproc_per_node")
FLAGS: dict[str, tuple[str, ...]] = {
    "env": ("json", *DISCOVERY_FLAGS),
    "run": ("cmd", *DISCOVERY_FLAGS, "log", "spawn"),
}
BOOLEAN = {"json", "spawn"}
HANDLED = ("env", "run")  # what ``main`` runs


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
    launch: str | None = None,
) -> NodeEnv:
    """This node's place, from the flags over ``conf`` (``launch``: a train's preflight, which
    follows only its own launch's membership, not an earlier one's)."""
    from .discovery import discover

    rank = None
    if node_rank is not None:
        if not whole(str(node_rank)):
            raise UsageError(f"--node-rank {str(node_rank)[:40]!r}: expected a whole number >= 0")
        rank = int(node_rank)
    return discover(
        pick(conf, "hostfile", hostfile),
        session=pick(conf, "session", session),
        node_rank=rank,
        master_port=pick_int(conf, "master_port", master_port),
        nproc_per_node=pick_int(conf, "nproc_per_node", nproc_per_node, allow_auto=True),
        include=pick(conf, "include", include),
        exclude=pick(conf, "exclude", exclude),
        launch=launch,
    )


def print_env(node: NodeEnv, as_json_output: bool) -> None:
    if as_json_output:
        import json  # only for --json

        print(json.dumps(as_json(node)))
    else:
        print(export_lines(node))


# ---- run ---------------------------------------------------------------------------------------


def _script(node: NodeEnv, cmd: str, log: str | None) -> str:
    if not log:
        return cmd
    target = log_target(log, node.node_rank)
    directory = os.path.dirname(target) or "."
    os.makedirs(directory, exist_ok=True)
    return logged(cmd, target)


def _recording(log: str | None) -> RankRecording | None:
    """A job's command (one with a log) gets the rank hook that ``meshkit diagnose`` reads, and
    torch's flight recorder, beside its log; any other command neither."""
    if not log:
        return None
    home = os.path.dirname(os.path.abspath(log))
    hook = os.path.join(os.path.dirname(os.path.abspath(__file__)), "node", "hook")
    return RankRecording(hook, errors_dir(home), home)


def exec_run(node: NodeEnv, cmd: str, log: str | None) -> NoReturn:
    """Replace this process with ``bash -c CMD`` carrying the node's variables."""
    script = _script(node, cmd, log)
    sys.stdout.flush()
    # Not Python's SIG_IGN for SIGPIPE: `yes | head` in the command must end quietly.
    reset_for_exec()
    env = environment(node, os.environ, sys.executable, _recording(log))
    os.execvpe("bash", ["bash", "-c", script], env)


SPAWN_LAUNCHERS = ("torch.distributed.run", "torch.distributed.launch")  # as python -m


def check_spawn_cmd(cmd: str) -> None:
    """``--spawn`` starts every rank itself: a launcher in CMD would start NPROC_PER_NODE
    launchers per node, each starting its own ranks, and the job would hang in rendezvous."""
    words = cmd.split()
    for i, word in enumerate(words[:8]):
        is_torchrun = word.rsplit("/", 1)[-1] == "torchrun"
        is_module_launcher = i > 0 and words[i - 1] == "-m" and word in SPAWN_LAUNCHERS
        if is_torchrun or is_module_launcher:
            raise UsageError(
                f"--spawn with {word[:60]!r} in --cmd: --spawn starts the node's ranks itself; "
                "run the script (python train.py), or drop --spawn and let the launcher start them"
            )


def spawn_run(node: NodeEnv, cmd: str, log: str | None) -> NoReturn:
    """NPROC_PER_NODE processes of ``bash -c CMD``, each with the node's variables and torchrun's
    worker variables (RANK, LOCAL_RANK, ...); exit with the first failure's code, else 0."""
    from .node.ranks import run_ranks

    check_spawn_cmd(cmd)
    script = _script(node, cmd, log)
    base = environment(node, os.environ, sys.executable, _recording(log))
    if node.nproc_per_node > 1 and "OMP_NUM_THREADS" not in base:
        # What torchrun sets: N ranks x all cores would oversubscribe.
        base["OMP_NUM_THREADS"] = "1"
    envs = []
    for local_rank in range(node.nproc_per_node):
        envs.append({**base, **rank_variables(node, local_rank)})
    sys.stdout.flush()
    raise SystemExit(run_ranks(script, envs))


# ---- the command line -------------------------------------------------------------------------


def parse(task: str, args: Sequence[str]) -> Flags:
    """``env``'s or ``run``'s flags (``run`` needs ``--cmd``), by the plain parser: ``Fallback``
    when it is not sure of them."""
    required: tuple[str, ...] = ()
    if task == "run":
        required = ("cmd",)
    return parse_flags(FLAGS[task], BOOLEAN, args, required)


def main(argv: Sequence[str]) -> bool:
    """``env``/``run`` with ``argv`` (task first): handle it and return True (``run`` never
    returns); False when it is not ours to handle. A meshkit error is printed and exits."""
    if not argv or argv[0] not in HANDLED:
        return False
    try:
        flags = parse(argv[0], argv[1:])
    except Fallback:
        return False
    values = flags.values
    try:
        conf = load()
        node = node_env(conf, **{name: values[name] for name in DISCOVERY_FLAGS})
        if argv[0] == "env":
            print_env(node, "json" in flags.given)
        elif "spawn" in flags.given:
            spawn_run(node, str(values["cmd"]), values["log"])
        else:
            exec_run(node, str(values["cmd"]), values["log"])
    except MeshkitError as exc:
        print(f"meshkit: {exc}", file=sys.stderr)
        raise SystemExit(exc.exit_code) from None
    return True
