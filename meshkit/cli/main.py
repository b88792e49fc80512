"""The ``meshkit`` console script: an invoke Program over the package's task collection.

``env`` and ``run`` go straight to ``meshkit.envrun``, which never imports invoke (they run on
every node at every launch), and ``exec`` to ``cli/execute.py`` (its whole run is a round of
seconds: the Program's start would be a good part of it); everything else, and anything unusual
about those three (help, a flag they do not know), goes to the Program.
"""

from __future__ import annotations

import os
import sys

from .. import __version__

TYPE_CHECKING = False  # no runtime `typing` on the env path (see meshkit/__init__.py)

if TYPE_CHECKING:
    from invoke.program import Program

# invoke's own core flags that mean something to meshkit; --pty, --echo, --warn-only, --config
# and the rest configure invoke's shell runner, which meshkit does not use.
CORE_FLAGS = ("--help", "--version", "--list", "--complete", "--print-completion-script")
USAGE_EXIT = 2
INTERRUPTED_EXIT = 130


def program() -> Program:
    from invoke.exceptions import Exit, ParseError
    from invoke.parser.argument import Argument
    from invoke.program import Program

    from .tasks import ns

    class MeshkitProgram(Program):
        def task_args(self) -> list[Argument]:
            return []  # --collection, --search-root: meshkit's collection is fixed

        def print_help(self) -> None:
            # invoke reads its other core flags internally, so they stay parseable; the help
            # lists only those that mean something to meshkit.
            print(f"Usage: {self.binary} [--help] [--version] <task> [--task-opts] ...")
            print("       meshkit <task> --help   (or -h): the task's own flags\n")
            print("Core options:\n")
            rows = self.initial_context.help_tuples()
            self.print_columns([row for row in rows if _is_core(row[0])])
            self.list_tasks()
            print("Exit codes: 0 ok, 1 failed on some node, 2 usage error, 130 interrupted.\n")

        def parse_core(self, argv: list[str] | None) -> None:
            try:
                super().parse_core(argv)
            except ParseError as exc:
                raise Exit(f"meshkit: {exc} (see meshkit --help)", USAGE_EXIT) from None

        def parse_tasks(self) -> None:
            try:
                super().parse_tasks()
            except ParseError as exc:
                raise Exit(f"meshkit: {exc} (see meshkit <task> --help)", USAGE_EXIT) from None

    name = "meshkit"
    return MeshkitProgram(
        namespace=ns, name=name, binary=name, binary_names=[name], version=__version__
    )


def _is_core(flags: str) -> bool:
    """Whether a help row (``-h, --help``, ``--complete[=...]``) names one of CORE_FLAGS."""
    for part in flags.split(","):
        flag = part.split("=")[0].split("[")[0].strip()
        if flag in CORE_FLAGS:
            return True
    return False


def main() -> None:
    from ..envrun import main as envrun

    argv = sys.argv[1:]
    try:
        if envrun(argv):
            return
        _watch_interrupts()
        if argv[:1] == ["exec"]:
            from .execute import main as execute

            if execute(argv):
                return
        program().run()
    except KeyboardInterrupt:
        print("meshkit: interrupted", file=sys.stderr)
        _leave(INTERRUPTED_EXIT)
    except BrokenPipeError:  # `meshkit ... | head`: the reader is gone, which is no error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        _leave(0)
    except SystemExit as exc:
        if _interrupted and exc.code not in (0, INTERRUPTED_EXIT):
            # invoke ends a Ctrl-C that lands outside a task's own handling (while it parses,
            # say) with a silent exit 1: it is an interruption, wherever it lands.
            print("meshkit: interrupted", file=sys.stderr)
            _leave(INTERRUPTED_EXIT)
        if exc.code == INTERRUPTED_EXIT:
            # Worker threads may still be blocked in a connect; the connections are closed
            # already, so leave now rather than wait for them (Ctrl-C ends within a second).
            _leave(INTERRUPTED_EXIT)
        raise


_interrupted = False


def _watch_interrupts() -> None:
    """SIGINT raises KeyboardInterrupt as Python's own handler does, and is remembered."""
    from ..node.signals import SIGINT, signal

    def interrupt(signum: int, frame: object) -> None:
        global _interrupted
        _interrupted = True
        raise KeyboardInterrupt

    signal(SIGINT, interrupt)


def _leave(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
