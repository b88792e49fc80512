"""The console script's own command-line parser, for its fast paths: ``env`` and ``run`` on every
node at every launch (``envrun``), ``exec`` on the controller (``cli/execute.py``). Not argparse:
its imports would be a noticeable part of every ``meshkit env`` on every node. It takes only what
it is sure of; anything else is ``Fallback``, and the invoke Program then parses the command line
and reports it as usual. Standard library only."""

from __future__ import annotations

from collections.abc import Sequence, Set

from .record import record


class Fallback(Exception):
    """Not something this parser handles: let the invoke Program do it (and report it)."""


@record
class Flags:
    """A command line's flags: each valued flag's value (``None`` when not given), and the
    booleans given."""

    values: dict[str, str | None]
    given: set[str]


def parse(
    names: Sequence[str], booleans: Set[str], args: Sequence[str], required: Sequence[str] = ()
) -> Flags:
    """``--name value``, ``--name=value`` and the booleans (those of ``names`` in ``booleans``)
    among ``names``. Anything else (help, a positional, an unknown or abbreviated flag, a missing
    value, a value that looks like a flag, a ``required`` flag not given) is ``Fallback``."""
    values: dict[str, str | None] = {name: None for name in names if name not in booleans}
    given: set[str] = set()
    rest = list(args)
    while rest:
        arg = rest.pop(0)
        if not arg.startswith("--"):
            raise Fallback
        written_name, equals_sign, value = arg[2:].partition("=")
        name = written_name.replace("-", "_")
        if "_" in written_name or name not in names:
            raise Fallback
        if name in booleans:
            if equals_sign:
                raise Fallback
            given.add(name)
            continue
        if not equals_sign:
            if not rest or rest[0].startswith("-"):
                raise Fallback
            value = rest.pop(0)
        values[name] = value
    for name in required:
        if values[name] is None:
            raise Fallback
    return Flags(values, given)
