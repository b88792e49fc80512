"""How long a supervised job is down when a node is lost for good and a spare takes its rank
(issue 34): from the node's power-off to the job running again on the new membership.

``python -m benchmarks.replacement [N] [--replace-after S] [--repeats R] [--out FILE]`` (root)
builds a sandbox of N active nodes and one spare (default 8 + 1), meshes it, and R times starts a
supervised job (``train --restarts 1 --replace-after S --cmd 'sleep 600'``: the job itself
costs nothing to start, so what is measured is meshkit's), waits until every supervisor watches
it, powers off node N-1 (``sandbox.poweroff``), and times, from the power-off:

- ``noticed``: the leader's supervisor logs that it waits for the node (a poll went unanswered);
- ``lost``: it logs the node lost (no answer for the bound since that poll, and a new connection
  failed too);
- ``claimed``: the new generation is claimed (the spare chosen and checked);
- ``running``: the leader logs that the attempt started, and every node of the new membership
  runs the job (read from the nodes' own process tables).

``running - S`` is meshkit's own cost on top of the bound the user chose. Prints one line per
repeat and writes the figures as JSON (``--out``, default
``benchmarks/results/replacement.json``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from meshkit import sandbox

from .supervised import Bench, down, runs_job, said, start, stop, up, wait

NAME = "brepl"
SESSION = "repl"  # repeat n's job is the session SESSION<n>, running ``sleep MARKER+n``
MARKER = 600


def one(
    bench: Bench, bound: float, n: int, session: str = SESSION, marker: int = MARKER
) -> dict[str, float]:
    """One repeat: the job ``SESSION<n>`` started, its last active node powered off, each step
    timed from the power-off (seconds); the job stopped and the node switched on again after."""
    name = f"{session}{n}"
    mark = str(marker + n)
    home = start(bench, name, mark, 1, bound)
    lay = bench.lay
    lost = bench.active - 1
    off = time.monotonic()
    sandbox.poweroff(lay, lost)
    try:
        noticed = wait(lambda: said(home, "waiting for"))
        lost_at = wait(lambda: said(home, " lost: "), bound + 120)
        claimed = wait(lambda: said(home, "generation 2:"))
        wait(lambda: said(home, "attempt 2 started"))
        members = [*range(lost), bench.spare]
        running = wait(lambda: all(runs_job(lay, i, mark) for i in members))
    finally:
        stop(bench, name)
        sandbox.poweron(lay, lost)
    return {
        "noticed": round(noticed - off, 2),
        "lost": round(lost_at - off, 2),
        "claimed": round(claimed - off, 2),
        "running": round(running - off, 2),
        "over_bound": round(running - off - bound, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("nodes", type=int, nargs="?", default=8, help="active nodes (default 8)")
    parser.add_argument("--replace-after", type=float, default=10.0, dest="bound")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/replacement.json")
    args = parser.parse_args()
    bench = up(NAME, args.nodes)
    samples: list[dict[str, float]] = []
    try:
        for n in range(args.repeats):
            figures = one(bench, args.bound, n)
            print(f"N={args.nodes}+1 spare, --replace-after {args.bound:.0f}s: {figures}")
            samples.append(figures)
    finally:
        down(NAME)
    medians = {key: statistics.median(sample[key] for sample in samples) for key in samples[0]}
    result = {
        "nodes": args.nodes,
        "spares": 1,
        "replace_after": args.bound,
        "samples": samples,
        "median": medians,
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"median: {medians}")


if __name__ == "__main__":
    main()
