"""How long a supervised job is down when a node breaks but still answers, beside when a node is
lost for good (issue 44): from the fault to the job running again on a spare, both paths timed
in one run on one sandbox.

``python -m benchmarks.recovery [N] [--repeats R] [--replace-after S] [--out FILE]`` (root)
builds a sandbox of N active nodes and one spare (default 8 + 1), meshes it, and R times runs
each path, each on a new supervised job (``train --restarts R --replace-after S --cmd 'sleep
MARKER'``: the job costs nothing to start, so what is timed is meshkit's), once every
supervisor watches it. The order of the two paths alternates from one repeat to the next.

**The XID path** (``train --restarts 2``): node N-1 gets an XID 79 in its kernel log
(``sandbox.fault(lay, N-1, xid=79)``: it still answers, its health reads unhealthy); from the
injection (wall clock: the nodes share this machine's):

- ``detected``: the time of the ``health`` event naming the node unhealthy (the event's own
  time, as the leader's supervisor recorded it);
- ``evicted``: the time of its ``evicted`` event;
- ``claimed``: the leader logs the new generation (the spare checked, the claim written);
- ``running``: the leader logs the next attempt started, and every node of the new membership
  runs the job (the nodes' own process tables).

The events are read from the job's shared home as ``meshkit events`` reads them
(``meshkit.node.events.read``, full time resolution), and each repeat checks that ``meshkit
events --json`` lists both. The fault is cleared after each repeat; the next repeat's new
session has the node back (an evicted node stays out of its own job only).

**The lost-node path**: ``replacement.one`` (node N-1 powered off): ``noticed``, ``lost``,
``claimed``, ``running``, as ``benchmarks/replacement.py`` documents them.

Prints one line per repeat and path, then the medians, and writes the figures with the commit,
the machine and its load average (start and end) as JSON (``--out``, default
``benchmarks/results/recovery.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from meshkit import sandbox
from meshkit.events import Event, EventKind
from meshkit.health import HealthState
from meshkit.node import events as node_events

from . import replacement
from .harness import RESULTS, commit, shared_run
from .supervised import Bench, down, node_meshkit, runs_job, said, start, stop, up, wait

NAME = "brecov"  # the sandbox: distinct from every test's and from replacement.py's
XID = 79  # "GPU has fallen off the bus": unhealthy
RESTARTS = 2
XID_SESSION = "xid"  # repeat n's jobs: xid<n> (sleep 700+n) and lost<n> (sleep 800+n)
XID_MARKER = 700
LOST_SESSION = "lost"
LOST_MARKER = 800
STEPS = {
    "xid": ("detected", "evicted", "claimed", "running"),
    "lost": ("noticed", "lost", "claimed", "running", "over_bound"),
}


def found(home: Path, since: float, match: Callable[[Event], bool]) -> Event | None:
    """The first event of the job at ``home`` since ``since`` (wall clock) that ``match``es."""
    for event in node_events.read(str(home), since):
        if match(event):
            return event
    return None


def made_unhealthy(label: str) -> Callable[[Event], bool]:
    said_so = f"{label} is {HealthState.UNHEALTHY}"
    return lambda event: (
        event.kind == EventKind.HEALTH and event.node == label and event.text.startswith(said_so)
    )


def evicted(label: str) -> Callable[[Event], bool]:
    return lambda event: event.kind == EventKind.EVICTED and event.node == label


def event_time(home: Path, since: float, match: Callable[[Event], bool]) -> float:
    """The wall time of the first matching event, once it is there (waited for)."""
    wait(lambda: found(home, since, match) is not None)
    event = found(home, since, match)
    assert event is not None
    return event.time


def listed(bench: Bench, session: str, label: str) -> None:
    """``meshkit events --json`` (from node 0) lists the node's health and evicted events."""
    flags = ["--json", "--hostfile", str(bench.hostfile), "--session", session]
    out = node_meshkit(bench.lay, 0, bench.work, "events", *flags)
    kinds = {event["kind"] for event in json.loads(out) if event.get("node") == label}
    missing = {str(EventKind.HEALTH), str(EventKind.EVICTED)} - kinds
    if missing:
        raise SystemExit(f"meshkit events --json has no {sorted(missing)} event for {label}")


def xid_one(bench: Bench, bound: float, n: int) -> dict[str, float]:
    """One repeat of the XID path: the job ``xid<n>`` started, an XID on node N-1, each step
    timed from the injection; the job stopped and the fault cleared after."""
    name = f"{XID_SESSION}{n}"
    mark = str(XID_MARKER + n)
    home = start(bench, name, mark, RESTARTS, bound)
    lay = bench.lay
    broken = bench.active - 1
    label = lay.nodes[broken].address  # as the hostfile spells it, as events name it
    wall = time.time()
    at = time.monotonic()
    sandbox.fault(lay, broken, xid=XID)
    try:
        # the steps seen as they happen first: the events are written to the nodes at the
        # supervisor's next look, later, and carry their own times
        claimed = wait(lambda: said(home, "generation 2:"))
        wait(lambda: said(home, "attempt 2 started"))
        members = [*range(broken), bench.spare]
        running = wait(lambda: all(runs_job(lay, i, mark) for i in members))
        detected = event_time(home, wall, made_unhealthy(label))
        out = event_time(home, wall, evicted(label))
        listed(bench, name, label)
    finally:
        stop(bench, name)
        sandbox.fault(lay, broken, clear=True)
    return {
        "detected": round(detected - wall, 2),
        "evicted": round(out - wall, 2),
        "claimed": round(claimed - at, 2),
        "running": round(running - at, 2),
    }


def lost_one(bench: Bench, bound: float, n: int) -> dict[str, float]:
    return replacement.one(bench, bound, n, LOST_SESSION, LOST_MARKER)


PATHS: dict[str, Callable[[Bench, float, int], dict[str, float]]] = {
    "xid": xid_one,
    "lost": lost_one,
}


def order(n: int) -> list[str]:
    """The paths in repeat ``n``'s order: alternating, so neither always runs first."""
    paths = list(PATHS)
    return paths if n % 2 == 0 else paths[::-1]


def medians(samples: dict[str, list[dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Each path's median of each step, over its repeats."""
    return {
        path: {step: statistics.median(one[step] for one in rows) for step in STEPS[path]}
        for path, rows in samples.items()
        if rows
    }


def line(path: str, label: str, figures: dict[str, float]) -> str:
    cells = "  ".join(f"{step} {figures[step]:6.2f}" for step in STEPS[path])
    return f"{path:<5} {label:<7} {cells}"


def table(samples: dict[str, list[dict[str, float]]]) -> str:
    """One line per repeat and path (seconds from the fault), then each path's medians."""
    lines = []
    for path, rows in samples.items():
        for n, figures in enumerate(rows):
            lines.append(line(path, f"#{n + 1}", figures))
    for path, figures in medians(samples).items():
        lines.append(line(path, "median", figures))
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("nodes", type=int, nargs="?", default=8, help="active nodes (default 8)")
    parser.add_argument("--repeats", type=int, default=3, help="of each path (default 3)")
    parser.add_argument(
        "--replace-after", type=float, default=10.0, dest="bound", help="seconds (default 10)"
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "recovery.json")
    args = parser.parse_args(argv)
    if args.nodes < 2 or args.repeats < 1 or args.bound <= 0:
        parser.error("N must be at least 2, --repeats at least 1, --replace-after above 0")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    measured = commit()  # before the run: the tree may change while it runs
    load_start = os.getloadavg()
    begun = time.time()
    bench = up(NAME, args.nodes)
    samples: dict[str, list[dict[str, float]]] = {path: [] for path in PATHS}
    try:
        for n in range(args.repeats):
            for path in order(n):
                figures = PATHS[path](bench, args.bound, n)
                print(line(path, f"#{n + 1}", figures), flush=True)
                samples[path].append(figures)
    finally:
        down(NAME)
    print(table(samples))
    result = {
        **shared_run(measured, begun, load_start),
        "nodes": args.nodes,
        "spares": 1,
        "replace_after": args.bound,
        "xid": XID,
        "restarts": RESTARTS,
        "samples": samples,
        "median": medians(samples),
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
