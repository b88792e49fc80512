"""How text reaches the operator's terminal: ``say`` for what may quote a node (reports,
errors), ``relay`` for a node's own output (``exec``, ``logs``). Without invoke, so that
``cli/execute.py``'s fast path can use it."""

from __future__ import annotations

import sys
from typing import TextIO

from ..terminal import visible


def say(text: str = "", file: TextIO | None = None, end: str = "\n") -> None:
    """``print`` for text that may hold what a node sent (a status row, an error, a frame, a
    doctor's detail): its control characters made visible (``terminal.visible``), whether the
    stream is a terminal or not. These are reports for people, read later with ``cat`` or
    ``less -R`` as well; machines read ``--json``."""
    print(visible(text), file=sys.stdout if file is None else file, end=end)


def relay(text: str, file: TextIO | None = None, end: str = "\n") -> None:
    """A node's own output (``exec``'s, a log's lines): on a terminal, its control characters
    made visible; into a pipe or a file, exactly as the node sent it, as pdsh passes it on (the
    output is then data: a file copied with ``cat``, colours for ``less -R``)."""
    stream = sys.stdout if file is None else file
    if stream.isatty():
        text = visible(text)
    print(text, file=stream, end=end)
