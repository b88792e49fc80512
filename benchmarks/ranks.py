"""What the goodput benchmark reads of a job's ranks, the same way under meshkit and under
torchrun: the progress files the ranks write (``meshkit.progress``) in each node's /tmp, read
from this machine's side of the sandbox, and the rank processes of a node (to kill or stop).

Under meshkit the keeper points ``MESHKIT_PROGRESS`` at the job's state directory
(``/tmp/meshkit-0/jobs/ID/progress``); under torchrun the benchmark sets it to
``/tmp/goodput-progress`` on every node. Either way each rank's file holds its steps in this
start of the process (``step``), the wall time of its first step (``first``) and of its last
write (``time``, at most about a second behind).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from dataclasses import dataclass
from pathlib import Path

from meshkit import sandbox
from meshkit.sandbox.system import netns_pids

ELASTIC_PROGRESS = "/tmp/goodput-progress"  # inside each node, under torchrun
PATTERNS = ("tmp/meshkit-0/jobs/*/progress/rank*.json", "tmp/goodput-progress/rank*.json")
ATTEMPT_SPREAD = 15.0  # seconds: the ranks of one start take their first steps this close


@dataclass(frozen=True)
class Told:
    """One rank's file: its steps in this start, its first step's and last write's times."""

    step: int
    first: float
    time: float


def read_one(path: Path) -> Told | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # replaced or removed while read: the next look sees it
    if not isinstance(data, dict):
        return None
    first = data.get("first")
    step = data.get("step")
    last = data.get("time")
    if not isinstance(first, list) or not first or not isinstance(step, int):
        return None
    if not isinstance(last, (int, float)) or not isinstance(first[0], (int, float)):
        return None
    return Told(step, float(first[0]), float(last))


def told(lay: sandbox.Layout, since: float) -> list[Told]:
    """Every rank file on every node whose first step came at or after ``since``."""
    found = []
    for node in lay.nodes:
        root = lay.node_dir(node)
        for pattern in PATTERNS:
            for path in root.glob(pattern):
                one = read_one(path)
                if one is not None and one.first >= since:
                    found.append(one)
    return found


@dataclass(frozen=True)
class Start:
    """The newest start of the job seen since a time: its first step's wall time, its steps
    so far and the wall time they were told at."""

    first: float
    steps: int
    time: float


def newest(lay: sandbox.Layout, since: float) -> Start | None:
    """The newest start whose ranks stepped since ``since`` (None: none yet): the files of the
    ranks that began within ``ATTEMPT_SPREAD`` of the newest one; its steps are the most any
    of them told (the ranks step together, and files are up to a second behind)."""
    files = told(lay, since)
    if not files:
        return None
    latest = max(one.first for one in files)
    mine = [one for one in files if one.first >= latest - ATTEMPT_SPREAD]
    ahead = max(mine, key=lambda one: (one.step, one.time))
    return Start(min(one.first for one in mine), ahead.step, ahead.time)


def rank_pids(lay: sandbox.Layout, index: int, script: str) -> list[int]:
    """This machine's ids of node ``index``'s rank processes: a Python interpreter running
    ``script`` itself (not torchrun's agent, nor the shell or ``meshkit run`` around it)."""
    node = lay.nodes[index]
    pids = []
    for pid in netns_pids(node.netns):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue  # exited meanwhile
        if not argv or not os.path.basename(argv[0]).startswith("python"):
            continue
        names = [os.path.basename(arg) for arg in argv if arg]
        agent = "torchrun" in names or "torch.distributed.run" in argv
        if script in names and not agent:
            pids.append(pid)
    return pids


def signal_ranks(lay: sandbox.Layout, index: int, script: str, sig: signal.Signals) -> int:
    """Send ``sig`` to node ``index``'s rank processes; how many there were."""
    pids = rank_pids(lay, index, script)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
    return len(pids)
