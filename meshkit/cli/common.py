"""What every task shares: flag help, flags over configuration, errors as exit codes, tables and
progress. The only place (with the task modules and ``printing``) that prints or exits."""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from invoke.exceptions import Exit
from invoke.tasks import Task
from invoke.tasks import task as invoke_task

from .. import settings
from ..errors import MeshkitError, UsageError
from ..record import fields
from ..terminal import visible

if TYPE_CHECKING:
    from ..outcome import PhaseEvent

HELP = {
    "hostfile": "hostfile path (default: config meshkit.hostfile, i.e. ./hostfile)",
    "include": "only these nodes: comma list of names, patterns (gpu*) or ranges (node[01-04])",
    "exclude": "leave out these nodes (same forms as --include)",
    "session": "job/session name (default: config meshkit.session, 'meshkit')",
    "json": "print JSON instead of text",
    "node_rank": "this node's rank, skipping discovery (also MESHKIT_NODE_RANK)",
    "master_port": "master port (default: derived from the hostfile and session, same on every "
    "node)",
    "nproc_per_node": "processes per node, or 'auto' (hostfile slots, else GPUs, else 1)",
    "cmd": "the command to run (bash); $NODE_RANK, $MASTER_ADDR etc. expand in it",
    "spawn": "start NPROC_PER_NODE copies of the command on each node, each with torchrun's "
    "worker variables (RANK, LOCAL_RANK, WORLD_SIZE, ...), instead of one launcher (torchrun) "
    "per node; one failing ends the node's others",
    "workdir": "the job's workdir (default: config meshkit.workdir, else found through the "
    "hostfile's job index, else the current directory)",
}


def task(**options: Any) -> Callable[[Callable[..., None]], Task[Any]]:
    """invoke's ``@task`` without its automatic short flags: they differed per task (``-h`` was
    --hostfile on some), so the only short flag left is ``-h`` for help, everywhere."""
    return invoke_task(auto_shortflags=False, **options)  # type: ignore[no-any-return]


class FlagsTask(Task[Any]):
    """An invoke task whose flags are a record's fields (each with its default), not its body's
    parameters: a command's flags are then declared once, in the record, which the console
    script's plain parser reads too (``cli/execute.py``). The body takes them as keywords. Made
    by ``@task(klass=FlagsTask, flags=RECORD)``."""

    def __init__(self, body: Callable[..., None], flags: type, **options: Any) -> None:
        self.flags = flags  # first: Task's own __init__ reads the flags (``argspec``)
        super().__init__(body, **options)

    def argspec(self, body: Callable[..., None]) -> inspect.Signature:
        """The flags as invoke reads a task's signature (the context left out)."""
        parameters = []
        for flag in fields(self.flags):
            keyword = inspect.Parameter.KEYWORD_ONLY
            parameters.append(inspect.Parameter(flag.name, keyword, default=flag.default))
        return inspect.Signature(parameters)


def helps(*names: str, **extra: str) -> dict[str, str]:
    """Help texts for the flags a task takes: shared wording from HELP, plus the task's own."""
    shared = {name: HELP[name] for name in names}
    return {**shared, **extra}


@functools.lru_cache(maxsize=1)
def conf() -> settings.Config:
    """The checked configuration (files and MESHKIT_* variables), read once per command."""
    return settings.load()


@contextmanager
def reported() -> Iterator[None]:
    """Turn meshkit's errors into a message and their exit code (1, or 2 for bad input), and
    Ctrl-C into 130, never a traceback. Connections opened inside are closed on the way out."""
    try:
        yield
    except MeshkitError as exc:
        sys.stdout.flush()
        # the message may quote a node (its error, its stderr): control characters made visible
        raise Exit(visible(f"meshkit: {exc}"), exc.exit_code) from None
    except KeyboardInterrupt:
        sys.stdout.flush()
        raise Exit("meshkit: interrupted", 130) from None


def rate(text: str, flag: str) -> float:
    """Bits per second from ``20Mbit``, ``1G``, ``500mbit/s``, ``1e9`` (k/M/G/T are powers of
    1000, as tc and ethtool count)."""
    import re

    pattern = r"([0-9.]+(?:e[0-9]+)?)\s*([kmgt]?)(?:bit(?:/s)?|bps)?"
    found = re.fullmatch(pattern, text.strip().lower())
    number = float(found.group(1)) if found and found.group(1).count(".") < 2 else 0.0
    if not found or number <= 0:
        raise UsageError(f"{flag} {text!r}: expected a rate such as 20Mbit, 1G or 100mbit/s")
    return number * 1000.0 ** " kmgt".index(found.group(2) or " ")


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain aligned text table; its cells' control characters made visible first, so that
    the columns stay aligned when a node's text had some."""
    lines = [[visible(str(header)) for header in headers]]
    for row in rows:
        lines.append(["" if value is None else visible(str(value)) for value in row])
    widths = [max(len(line[i]) for line in lines) for i in range(len(headers))]
    text = []
    for line in lines:
        padded = [cell.ljust(width) for cell, width in zip(line, widths)]
        text.append("  ".join(padded).rstrip())
    return "\n".join(text)


def progress(event: PhaseEvent) -> None:
    """``phase  done/total`` on stderr: redrawn in place on a terminal, one line when finished."""
    out = sys.stderr
    terminal = out.isatty()
    if not event.phase:
        return
    if not event.finished and not terminal:
        return  # elsewhere only the finished phase's line, not every step
    line = f"  {event.phase:<9} {event.done}/{event.total}"
    if event.finished:
        failed = f", {event.failed} failed" if event.failed else ""
        line += f"{failed}  ({event.elapsed:.2f}s)\n"
    if terminal:
        line = "\r" + line
    out.write(line)
    out.flush()


HEALTH_WIDTH = 40  # a node's health in a table (status, top): the rest is said below it


def shorten(text: str, width: int) -> str:
    """``text`` cut to ``width`` characters, an ellipsis saying it was."""
    if len(text) <= width:
        return text
    return text[: width - 3] + "..."
