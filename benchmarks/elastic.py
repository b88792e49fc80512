"""The goodput benchmark's baseline: the same job under torchrun's elastic agent, as users start
it today: ``pdsh -R ssh`` from node 0 runs ``torchrun --nnodes MIN:ALL --max-restarts 3
--rdzv-backend c10d --rdzv-endpoint NODE0:PORT`` on every node of the sandbox (the spares too:
torchrun has no spares, only a range of nodes). pdsh's output, every node's lines, goes to one
log in the shared working directory. Each rank writes its progress to ``/tmp/goodput-progress``
on its node (``MESHKIT_PROGRESS`` set by hand), which is how the benchmark reads its steps.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from meshkit import sandbox
from meshkit.sandbox.system import netns_pids, nsenter

from .ranks import ELASTIC_PROGRESS

MAX_RESTARTS = 3
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


@dataclass
class Elastic:
    """One torchrun job: pdsh on node 0 (this machine's process) and its log."""

    pdsh: subprocess.Popen[bytes]
    log: Path


def command(work: Path, rdzv: str, job_id: str, active: int, every: int, train: str) -> str:
    """What pdsh runs on each node: the progress directory made, then torchrun in ``work``."""
    nnodes = f"{active}:{every}"
    torchrun = [TORCHRUN, "--nnodes", nnodes, "--nproc-per-node", "1"]
    torchrun += ["--max-restarts", str(MAX_RESTARTS), "--rdzv-backend", "c10d"]
    torchrun += ["--rdzv-endpoint", rdzv, "--rdzv-id", job_id]
    return (
        f"mkdir -p -m 700 {ELASTIC_PROGRESS} && cd {shlex.quote(str(work))} && "
        f"MESHKIT_PROGRESS={ELASTIC_PROGRESS} {shlex.join(torchrun)} {train}"
    )


def start(
    lay: sandbox.Layout, work: Path, job_id: str, port: int, active: int, train: str
) -> Elastic:
    """torchrun on every node of ``lay`` by pdsh from node 0; ``train`` is the script and its
    flags (shell words). Returns at once: the caller waits for the steps."""
    every = len(lay.nodes)
    rdzv = f"{lay.nodes[0].address}:{port}"
    remote = command(work, rdzv, job_id, active, every, train)
    hosts = ",".join(node.address for node in lay.nodes)
    log = work / f"{job_id}.log"
    argv = [*nsenter(lay.nodes[0]), "pdsh", "-R", "ssh", "-f", str(every), "-w", hosts, remote]
    with log.open("wb") as out:
        pdsh = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    return Elastic(pdsh, log)


def stop(lay: sandbox.Layout, job: Elastic, script: str) -> None:
    """End the job everywhere: pdsh, then every node's torchrun agent and ranks (killed: a
    stopped rank does not stop otherwise)."""
    job.pdsh.kill()
    job.pdsh.wait()
    for node in lay.nodes:
        for pid in netns_pids(node.netns):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if script in argv or TORCHRUN in argv:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
