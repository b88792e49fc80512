"""``events``: parse, call ``ops.events``, render the job's history."""

from __future__ import annotations

import datetime
import json as jsonlib
import sys
import time
from typing import TYPE_CHECKING

from invoke.context import Context
from invoke.exceptions import Exit

from ...job import parse_duration
from ...ops import lookup
from ...ops.pool import connect
from ..common import conf, helps, progress, reported, table, task
from ..printing import say

if TYPE_CHECKING:  # every command builds the task list; only this task loads its op
    from ...events import Event
    from ...hostfile import Host

HEADERS = ["time (UTC)", "kind", "node", "rank", "gen", "attempt", "detail"]


@task(
    help=helps(
        "hostfile",
        "session",
        "workdir",
        json="print JSON: a list, oldest first (with --follow: one object a line)",
        follow="keep printing new events as they come (every 2 s; Ctrl-C to stop)",
        since="only the events of this last while: 90s, 30m, 1h, 48h (default: all)",
    )
)
def events(
    context: Context,
    hostfile: str | None = None,
    session: str | None = None,
    workdir: str | None = None,
    json: bool = False,
    follow: bool = False,
    since: str | None = None,
) -> None:
    """The job's history: every launch, attempt, failure (with its cause), restart, stall,
    health change, loss, replacement, eviction, shrink, give-up, done and stop, with time,
    node, rank, generation and attempt. Read from every node of the hostfile (spares
    included) and merged, so it survives any node being off; works from any node and any
    directory, as status does."""
    from ...ops import events as op

    with reported():
        start = since_flag(since)
        if not follow:
            _, history = op.read(conf(), hostfile, session, workdir, start, progress)
            if json:
                print(jsonlib.dumps([event.as_json() for event in history.events]))
            else:
                say(render(history.events))
            unread(history.failures)
            if history.failures:
                raise Exit(code=1)
            return
        job, hosts = lookup.saved(conf(), hostfile, session, workdir)
        nodes = op.every_node(job, hosts)
        told: set[Host] = set()
        with connect(conf(), job.hostfile, nodes, job.python, progress) as pool:
            headed = False
            for found in op.follow(pool, job, nodes, start):
                if json:
                    for event in found.events:
                        print(jsonlib.dumps(event.as_json()))
                elif found.events:
                    say(render(found.events, headers=not headed))
                    headed = True
                new = {host: why for host, why in found.failures.items() if host not in told}
                unread(new)
                told |= set(new)
                sys.stdout.flush()


def since_flag(since: str | None) -> float | None:
    """``--since DURATION`` as a wall-clock time (None: the whole history)."""
    if since is None:
        return None
    seconds = parse_duration(since, "--since")
    if seconds is None:  # "off": no bound
        return None
    return time.time() - seconds


def unread(failures: dict[Host, str]) -> None:
    """The nodes whose copy could not be read (the others' copies are shown)."""
    for host, why in failures.items():
        say(f"meshkit: events: {host.label}: not read: {why}", sys.stderr)


def render(events: list[Event], headers: bool = True) -> str:
    """The table: one row an event, oldest first; a node's text made safe by ``table``."""
    cells = []
    for event in events:
        stamp = datetime.datetime.fromtimestamp(event.time, datetime.timezone.utc)
        when = stamp.strftime("%Y-%m-%d %H:%M:%S")
        rank = "" if event.rank is None else event.rank
        detail = " ".join(event.text.split())[:200]  # one line, whatever the writer sent
        row = (when, event.kind, event.node or "", rank, event.generation, event.attempt, detail)
        cells.append(row)
    if not cells and headers:
        return "no events"
    lines = table(HEADERS, cells).splitlines()
    return "\n".join(lines if headers else lines[1:])
