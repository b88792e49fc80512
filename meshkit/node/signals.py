"""Signal numbers and dispositions for the node's hot paths, from ``_signal``: the ``signal``
module is its C core plus enums for the names, and the enum import alone would be paid by
every keeper and every ``meshkit run``, on every node at every launch. Type checkers see
``signal`` (the same functions; the constants there are ``IntEnum`` members, here plain
ints). Standard library only."""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from signal import SIG_DFL, SIG_IGN, SIGHUP, SIGINT, SIGKILL, SIGPIPE, SIGTERM, SIGXFSZ, signal
else:
    from _signal import SIG_DFL, SIG_IGN, SIGHUP, SIGINT, SIGKILL, SIGPIPE, SIGTERM, SIGXFSZ, signal

__all__ = ["SIGHUP", "SIGINT", "SIGKILL", "SIGTERM", "SIG_DFL", "SIG_IGN", "signal"]

# Python ignores these in itself, and an ignored signal stays ignored across exec: a command
# started from Python gets them back at their defaults (as Popen's restore_signals does), or
# `yes | head -1` in a job reports "Broken pipe" instead of ending quietly.
RESET_FOR_EXEC = (SIGPIPE, SIGXFSZ)


def reset_for_exec() -> None:
    """Before this process execs a command: give it SIGPIPE and SIGXFSZ at their defaults."""
    for number in RESET_FOR_EXEC:
        signal(number, SIG_DFL)


def exit_code(status: int) -> int:
    """A wait status as a shell reports it: the exit code, or 128 + N when signal N ended it."""
    import os  # already loaded everywhere this runs

    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code
