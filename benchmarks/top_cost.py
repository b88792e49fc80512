"""What ``meshkit top`` costs the nodes, and the refresh it keeps, at N nodes (issue 35, item 3).

``python -m benchmarks.top_cost N [N ...] [--seconds S] [--interval I] [--out FILE]`` (root)
builds a sandbox of N nodes for each N, meshes it, and runs ``meshkit top --interval I`` (the
plain view, as off a terminal) for S seconds. It records:

- the node side's CPU: the agent (``python -m meshkit.node serve``) and its sshd session process on
  every node, read from /proc as user+system ticks once the first snapshot is out (the agent's
  start is not top's steady cost) and again at the end; given as CPU seconds per minute of top per
  node (mean and max over the nodes) and as a share of one core (the target: under 1% at 2 s);
- the refresh achieved: the snapshots printed in S seconds, as the median and largest gap between
  two, against the interval asked for (the target: 2 s kept at N=64);
- the controller's own CPU (meshkit's process) per minute.

On the sandbox the nodes share this machine's cores with the controller, so the refresh at large N
is a bound from below of what separate machines would keep. Prints one line per N and writes the
figures as JSON (``--out``, default ``benchmarks/results/top-cost.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

from meshkit import sandbox
from meshkit.sandbox.system import netns_pids

NAME = "btop"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
HEADER = re.compile(r"^meshkit top  \d\d:\d\d:\d\d  (\d+)/(\d+) nodes up")


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def ticks(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            stat = handle.read()
    except OSError:
        return 0
    columns = stat[stat.rfind(")") + 2 :].split()
    return int(columns[11]) + int(columns[12])


def top_processes(lay: sandbox.Layout) -> dict[str, list[int]]:
    """Per node: its agent and the sshd session process that carries it (``sshd: root@notty``)."""
    found = {}
    for node in lay.nodes:
        pids = []
        for pid in netns_pids(node.netns):
            line = cmdline(pid)
            if "meshkit.node serve" in line or "@notty" in line:
                pids.append(pid)
        found[node.name] = pids
    return found


def node_ticks(processes: dict[str, list[int]]) -> dict[str, int]:
    return {name: sum(ticks(pid) for pid in pids) for name, pids in processes.items()}


class Snapshots:
    """The view's output, read in a thread: when each snapshot's header line came."""

    def __init__(self, stream: IO[str]) -> None:
        self.times: list[float] = []
        self.up: list[int] = []
        self.thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self.thread.start()

    def _read(self, stream: IO[str]) -> None:
        for line in iter(stream.readline, ""):
            found = HEADER.match(line)
            if found:
                self.times.append(time.monotonic())
                self.up.append(int(found.group(1)))


def measure(count: int, seconds: float, interval: float) -> dict[str, object]:
    root = f"/var/tmp/meshkit-bench-sandbox-{NAME}{count}"
    name = f"{NAME}{count}"[:8]
    lay = sandbox.up(root, sandbox.default_subnet("", name), count, name, kex="openssh")
    try:
        hostfile = str(lay.hostfile)
        meshkit = [sys.executable, "-m", "meshkit"]
        subprocess.run([*meshkit, "mesh", "--hostfile", hostfile, "--no-verify"], check=True,
                       capture_output=True, timeout=600)  # fmt: skip
        argv = [*meshkit, "top", "--hostfile", hostfile, "--interval", str(interval)]
        view = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, cwd=lay.shared)
        snapshots = Snapshots(view.stdout)
        deadline = time.monotonic() + 300
        while not snapshots.times and time.monotonic() < deadline:
            time.sleep(0.1)
        if not snapshots.times:
            view.kill()
            raise SystemExit(f"N={count}: no snapshot within 300 s")
        processes = top_processes(lay)
        before = node_ticks(processes)
        started = time.monotonic()
        first = len(snapshots.times)
        controller_before = ticks(view.pid)
        time.sleep(seconds)
        after = node_ticks(processes)
        controller_after = ticks(view.pid)
        elapsed = time.monotonic() - started
        view.terminate()
        view.wait(timeout=30)
    finally:
        sandbox.down(root, name)
    minutes = elapsed / 60
    per_node = [(after[node] - before[node]) / CLOCK_TICKS / minutes for node in before]
    times = snapshots.times[first - 1 :]
    gaps = [later - earlier for earlier, later in zip(times, times[1:])]
    result = {
        "nodes": count,
        "interval": interval,
        "seconds": round(elapsed, 1),
        "node_cpu_s_per_minute_mean": round(statistics.mean(per_node), 4),
        "node_cpu_s_per_minute_max": round(max(per_node), 4),
        "node_core_share_mean_percent": round(statistics.mean(per_node) / 60 * 100, 3),
        "controller_cpu_s_per_minute": round(
            (controller_after - controller_before) / CLOCK_TICKS / minutes, 3
        ),
        "snapshots": len(times),
        "refresh_median_s": round(statistics.median(gaps), 2) if gaps else None,
        "refresh_max_s": round(max(gaps), 2) if gaps else None,
        "nodes_up_last": snapshots.up[-1] if snapshots.up else 0,
    }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("nodes", type=int, nargs="+")
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--interval", type=float, default=2.0)
    parser.add_argument("--out", default="benchmarks/results/top-cost.json")
    args = parser.parse_args()
    results = []
    for count in args.nodes:
        result = measure(count, args.seconds, args.interval)
        results.append(result)
        print(json.dumps(result), flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=False).stdout.strip()  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"commit": commit, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
