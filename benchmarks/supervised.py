"""A supervised job on a sandbox with one spare, as the recovery benchmarks time it
(``replacement.py``: a node lost for good; ``recovery.py``: that and a broken node evicted):
the sandbox built and meshed (``up``), a ``sleep`` job started under ``train``'s supervision and
watched by every supervisor (``start``), its supervisor logs and the nodes' process tables read
(``said``, ``runs_job``), a step waited for (``wait``), the job stopped (``stop``).

The job is ``sleep MARKER``: it costs nothing to start, so what is timed is meshkit's, and each
run's own marker tells its processes apart from an earlier run's.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from meshkit import sandbox
from meshkit.sandbox.layout import default_subnet

SETTLE = 5.0  # seconds the supervisors get to settle into watching before the fault
STEP_TIMEOUT = 120.0  # the longest any one step is waited for


@dataclass(frozen=True)
class Bench:
    """A meshed sandbox of ``active`` nodes and one spare (the last node), its hostfile (the
    spare marked ``spare``) and a shared working directory every node sees."""

    lay: sandbox.Layout
    hostfile: Path
    work: Path
    active: int

    @property
    def spare(self) -> int:
        return self.active


def up(name: str, active: int) -> Bench:
    """The sandbox ``name`` (root: ``/var/tmp/meshkit-bench-NAME``), ``active`` nodes and a
    spare, meshed from this machine. ``down`` removes it."""
    root = Path(f"/var/tmp/meshkit-bench-{name}")
    lay = sandbox.up(root, default_subnet("", name), active + 1, name, kex="openssh")
    hostfile = lay.root / "hostfile-spare"
    lines = [node.address for node in lay.nodes[:active]]
    lines.append(f"{lay.nodes[active].address} spare")
    hostfile.write_text("\n".join(lines) + "\n")
    mesh = [sys.executable, "-m", "meshkit", "mesh", "--hostfile", str(hostfile), "--no-verify"]
    subprocess.run(mesh, check=True, capture_output=True)
    work = lay.shared / "work"
    work.mkdir(exist_ok=True)
    return Bench(lay, hostfile, work, active)


def down(name: str) -> None:
    sandbox.down(Path(f"/var/tmp/meshkit-bench-{name}"), name)


def node_meshkit(lay: sandbox.Layout, index: int, cwd: Path, *args: str) -> str:
    """``meshkit ARGS`` inside node ``index``, as a user logged in there; its output."""
    line = f"cd {shlex.quote(str(cwd))} && {shlex.join([sys.executable, '-m', 'meshkit', *args])}"
    out = sandbox.node_exec(lay.nodes[index], ["bash", "-c", line], timeout=300)
    if out.returncode != 0:
        raise SystemExit(f"meshkit {args[0]} failed: {out.stdout}{out.stderr}")
    return out.stdout


def said(home: Path, text: str) -> bool:
    """Whether any supervisor's log of the job whose home is ``home`` has ``text``."""
    return any(text in log.read_text() for log in home.glob("supervisor-node*.log"))


def runs_job(lay: sandbox.Layout, index: int, marker: str) -> bool:
    """Whether node ``index`` runs ``sleep MARKER`` (its own process table)."""
    out = sandbox.node_exec(lay.nodes[index], ["pgrep", "-f", f"^sleep {marker}"])
    return bool(out.stdout.strip())


def wait(predicate: Callable[[], bool], timeout: float = STEP_TIMEOUT) -> float:
    """The monotonic time at which ``predicate()`` first held (polled every 0.2 s), or raise."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise SystemExit("not reached in time")
        time.sleep(0.2)
    return time.monotonic()


def start(bench: Bench, session: str, marker: str, restarts: int, bound: float) -> Path:
    """``train --restarts R --replace-after S --cmd 'sleep MARKER'`` from node 0 as ``session``;
    returns once every node runs the job, every supervisor watches it and ``SETTLE`` seconds
    passed. Returns the job's home (its supervisor logs and events)."""
    flags = ["--hostfile", str(bench.hostfile), "--session", session]
    flags += ["--restarts", str(restarts), "--replace-after", f"{bound:.0f}s"]
    flags += ["--cmd", f"sleep {marker}"]
    node_meshkit(bench.lay, 0, bench.work, "train", *flags)
    home = bench.work / ".meshkit" / session
    wait(lambda: all(runs_job(bench.lay, i, marker) for i in range(bench.active)))
    # a fault mid-run: every supervisor up, and the leader past its first look
    logs = [home / f"supervisor-node{rank}.log" for rank in range(bench.active)]
    wait(lambda: all(log.exists() and "supervising" in log.read_text() for log in logs))
    time.sleep(SETTLE)
    return home


def stop(bench: Bench, session: str) -> None:
    flags = ["--hostfile", str(bench.hostfile), "--session", session]
    node_meshkit(bench.lay, 0, bench.work, "stop", *flags)
