"""Where the CPU of an operation goes at N nodes: this machine's, and the controller's share.

``python -m benchmarks.cpu_split N [OUT]`` (root) builds one sandbox of N nodes with the conda-like
bashrc and runs, in turn: the floor (N parallel ``ssh node true``), ``meshkit mesh --no-verify``,
the floor again, ``meshkit train`` of a sleeping command until every session runs, ``status`` and
``stop``, with the wheel the benchmark installed (run the benchmark once first). For each it
records the wall time, the CPU all cores spent (/proc/stat) and the CPU of the command's own
processes on the controller (the ssh clients, or meshkit's one process): the rest is the nodes'.
On this machine the nodes share the controller's cores; on N machines only the controller's
share stays on one machine, so it is what bounds an operation's time as N grows.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from pathlib import Path

from meshkit import sandbox

from . import peers
from .harness import machine_busy

NAME = "bcpu"
ROOT = "/var/tmp/meshkit-bench-sandbox-bcpu"
KEX = "openssh"  # as the main benchmark's nodes (cluster.KEX)


def timed(argvs: list[list[str]], cwd: Path) -> dict[str, object]:
    """Run the commands at once; wall time, all cores' CPU, and theirs."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    busy = machine_busy()
    start = time.perf_counter()
    procs = [
        subprocess.Popen(a, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=cwd)
        for a in argvs
    ]
    codes = [p.wait(900) for p in procs]
    wall = time.perf_counter() - start
    machine = machine_busy() - busy
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    mine = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return {
        "wall_s": round(wall, 2),
        "machine_cpu_s": round(machine, 2),
        "controller_cpu_s": round(mine, 2),
        "ok": not any(codes),
    }


def main() -> None:
    n = int(sys.argv[1])
    meshkit = str(peers.CACHE / "meshkit" / "venv" / "bin" / "meshkit")
    lay = sandbox.up(ROOT, sandbox.default_subnet("", NAME), n, NAME, bashrc="conda", kex=KEX)
    out: dict[str, object] = {"nodes": n, "bashrc": "conda"}
    try:
        ssh = [
            ["ssh", "-F", str(lay.ssh_config), "-o", "BatchMode=yes", x.name, "true"]
            for x in lay.nodes
        ]
        job = ["--hostfile", str(lay.hostfile), "--session", "cpu", "--workdir", str(lay.shared)]
        steps = [
            ("floor_fresh", ssh),
            ("mesh_no_verify", [[meshkit, "mesh", "--hostfile", str(lay.hostfile), "--no-verify"]]),
            ("floor_meshed", ssh),
            ("train_sessions_up", [[meshkit, "train", *job, "--cmd", "sleep 600"]]),
            ("status", [[meshkit, "status", *job, "--json"]]),
            ("stop", [[meshkit, "stop", *job]]),
        ]
        for name, argvs in steps:
            out[name] = timed(argvs, lay.shared)
            print(name, out[name], file=sys.stderr, flush=True)
    finally:
        sandbox.down(ROOT, NAME)
    text = json.dumps(out, indent=2) + "\n"
    if len(sys.argv) > 2:
        Path(sys.argv[2]).write_text(text)
    print(text, end="")


if __name__ == "__main__":
    main()
