"""``exec`` as an invoke task: its help; its flags (``ExecFlags``), the run and its output are
``cli/execute.py``'s, which the console script also calls without invoke."""

from __future__ import annotations

from invoke.context import Context
from invoke.exceptions import Exit

from ...errors import UsageError
from ...record import build
from ..common import FlagsTask, conf, helps, reported, task
from ..execute import ExecFlags, run

EXEC_HELP = helps(
    "hostfile",
    "include",
    "exclude",
    "session",
    cmd="the command every node runs (bash, in the user's home directory); $NODE_RANK, "
    "$MASTER_ADDR etc. expand there, with each node's own values",
    node="only these ranks: 2 or 0-3,5",
    timeout="seconds each node's command may take; then its process group is killed "
    "(default: config command_timeout, 120)",
    lines="each output line prefixed with its node, instead of identical outputs grouped",
    json='print [{"node", "rank", "exit_code", "stdout", "stderr", "error", "stdout_cut_bytes", '
    '"stderr_cut_bytes"}] instead (bytes each node cut from the middle of each stream)',
)


@task(name="exec", help=EXEC_HELP, klass=FlagsTask, flags=ExecFlags)
def exec_(context: Context, **given: str | bool | None) -> None:
    """Run CMD on every node at once, each with its meshkit env variables; gather the output.

    Identical outputs are shown once under the nodes that printed them (node[0-3,5]), as
    clush -b does; stderr lines go to stderr, each prefixed with its node. Each node keeps the
    first and last 32 KiB of each stream and says how much it cut. On a terminal, control
    characters are shown (ESC as \x1b), never obeyed; into a pipe, output is passed on as sent.
    Exit 1 when any node failed or did not answer (each named, with why); Ctrl-C ends the
    command on every node.
    """
    flags = build(ExecFlags, given, "exec")
    with reported():
        if flags.cmd is None:
            raise UsageError("exec: give the command: meshkit exec --cmd CMD")
        failure = run(conf(), flags.cmd, flags)
    if failure is not None:
        raise Exit(failure, 1)
