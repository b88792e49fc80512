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
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from meshkit import sandbox
from meshkit.sandbox.layout import default_subnet

NAME = "brepl"
SETTLE = 5.0  # seconds the supervisors get to settle into watching before the power-off


def node_meshkit(lay: sandbox.Layout, index: int, cwd: Path, *args: str) -> str:
    """``meshkit ARGS`` inside node ``index``, as a user logged in there; its output."""
    line = f"cd {shlex.quote(str(cwd))} && {shlex.join([sys.executable, '-m', 'meshkit', *args])}"
    out = sandbox.node_exec(lay.nodes[index], ["bash", "-c", line], timeout=300)
    if out.returncode != 0:
        raise SystemExit(f"meshkit {args[0]} failed: {out.stdout}{out.stderr}")
    return out.stdout


def said(home: Path, text: str) -> bool:
    return any(text in log.read_text() for log in home.glob("supervisor-node*.log"))


def runs_job(lay: sandbox.Layout, index: int, marker: str) -> bool:
    out = sandbox.node_exec(lay.nodes[index], ["pgrep", "-f", f"^sleep {marker}"])
    return bool(out.stdout.strip())


def wait(predicate, timeout: float) -> float:
    """Seconds until ``predicate()`` holds (polled every 0.2 s), or raise."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise SystemExit("not reached in time")
        time.sleep(0.2)
    return time.monotonic()


def one(lay: sandbox.Layout, hostfile: Path, work: Path, active: int, bound: float, n: int):
    session = f"repl{n}"
    marker = str(600 + n)  # each repeat's own sleep, told apart by its argument
    flags = ["--hostfile", str(hostfile), "--session", session, "--restarts", "1"]
    flags += ["--replace-after", f"{bound:.0f}s", "--cmd", f"sleep {marker}"]
    node_meshkit(lay, 0, work, "train", *flags)
    home = work / ".meshkit" / session
    wait(lambda: all(runs_job(lay, i, marker) for i in range(active)), 120)
    # a node lost mid-run: every supervisor up, and the leader past its first look
    logs = [home / f"supervisor-node{rank}.log" for rank in range(active)]
    wait(lambda: all(log.exists() and "supervising" in log.read_text() for log in logs), 120)
    time.sleep(SETTLE)
    lost = active - 1
    spare = active
    off = time.monotonic()
    sandbox.poweroff(lay, lost)
    try:
        noticed = wait(lambda: said(home, "waiting for"), 120)
        lost_at = wait(lambda: said(home, " lost: "), bound + 120)
        claimed = wait(lambda: said(home, "generation 2:"), 120)
        wait(lambda: said(home, "attempt 2 started"), 120)
        members = [*range(lost), spare]
        running = wait(lambda: all(runs_job(lay, i, marker) for i in members), 120)
    finally:
        node_meshkit(lay, 0, work, "stop", "--hostfile", str(hostfile), "--session", session)
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
    root = Path(f"/var/tmp/meshkit-bench-{NAME}")
    lay = sandbox.up(root, default_subnet("", NAME), args.nodes + 1, NAME, kex="openssh")
    samples = []
    try:
        hostfile = lay.root / "hostfile-spare"
        lines = [node.address for node in lay.nodes[: args.nodes]]
        lines.append(f"{lay.nodes[args.nodes].address} spare")
        hostfile.write_text("\n".join(lines) + "\n")
        mesh = [sys.executable, "-m", "meshkit", "mesh", "--hostfile", str(hostfile), "--no-verify"]
        subprocess.run(mesh, check=True, capture_output=True)
        work = lay.shared / "work"
        work.mkdir(exist_ok=True)
        for n in range(args.repeats):
            figures = one(lay, hostfile, work, args.nodes, args.bound, n)
            print(f"N={args.nodes}+1 spare, --replace-after {args.bound:.0f}s: {figures}")
            samples.append(figures)
    finally:
        sandbox.down(root, NAME)
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
