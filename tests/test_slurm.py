"""Real SLURM (Debian slurm-wlm + munge) on the sandbox nodes, as ``meshkit sandbox.up --slurm``
offers it: srun and sbatch as rank sources for ``meshkit env`` and ``init_distributed()``, with no
hostfile at all."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import fresh_sandbox, sandbox_name

from meshkit import sandbox
from meshkit.sandbox import slurm

NAME = sandbox_name(__name__)
NODES = 4
JOB_TIMEOUT = 300.0  # a bound, not a speed check
TRAIN = """\
import pathlib
import socket
import sys

import torch
import torch.distributed as dist

from meshkit.torch import init_distributed

place = init_distributed(timeout=240)
value = torch.tensor([float(place.rank + 1)])
dist.all_reduce(value)
line = f"RESULT {socket.gethostname()} {place.rank} {place.world_size} {value.item()}"
pathlib.Path(sys.argv[1], f"rank{place.rank}").write_text(line)  # one file per rank: whole lines
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def lay() -> Iterator[sandbox.Layout]:
    with fresh_sandbox(NAME, NODES, slurm=True) as layout:
        yield layout
    assert not any(
        n.startswith(f"meshkit-{NAME}-")
        for n in subprocess.check_output(["ip", "netns"], text=True).split()
    )


def in_node(
    lay: sandbox.Layout, argv: list[str], node: int = 1
) -> subprocess.CompletedProcess[str]:
    """A SLURM client inside a node, as a user logged in there would run it."""
    return sandbox.node_exec(
        lay.nodes[node],
        [
            "env",
            f"SLURM_CONF={slurm.conf_path(lay)}",
            "timeout",
            str(int(JOB_TIMEOUT)),
            *argv,
        ],
        timeout=JOB_TIMEOUT + 10,
    )


def test_slurm_is_private_to_the_sandbox(lay: sandbox.Layout) -> None:
    assert slurm.idle_nodes(lay) == [n.name for n in lay.nodes]
    conf = slurm.conf_path(lay).read_text()
    assert f"AuthInfo=socket={slurm.munge_socket(lay)}" in conf
    assert f"NodeName=node3 NodeAddr={lay.nodes[3].address} NodeHostname=node3" in conf
    assert "/etc/slurm" not in conf
    assert "/run/" not in conf


def test_srun_env_without_hostfile(lay: sandbox.Layout) -> None:
    done = in_node(
        lay, ["srun", "-N4", "--chdir=/", sys.executable, "-m", "meshkit", "env", "--json"]
    )
    assert done.returncode == 0, done.stdout + done.stderr
    got = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert sorted(int(g["NODE_RANK"]) for g in got) == [0, 1, 2, 3]
    assert {(g["MASTER_ADDR"], g["NNODES"], g["NPROC_PER_NODE"], g["source"]) for g in got} == {
        ("node0", "4", "1", "slurm")
    }
    assert {g["matched"] for g in got} == {"SLURM_NODEID"}
    assert len({g["MASTER_PORT"] for g in got}) == 1


def test_srun_two_tasks_per_node_each_node_agrees(lay: sandbox.Layout) -> None:
    probe = (
        "import json, socket, subprocess, sys; "
        "out = subprocess.run([sys.executable, '-m', 'meshkit', 'env', '--json'], "
        "capture_output=True, text=True, timeout=120); "
        "print('ENV', socket.gethostname(), json.loads(out.stdout)['NODE_RANK'], flush=True)"
    )
    done = in_node(
        lay, ["srun", "-N4", "--ntasks-per-node=2", "--chdir=/", sys.executable, "-c", probe]
    )
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {tuple(line.split()[1:]) for line in done.stdout.splitlines() if line.startswith("ENV")}
    assert rows == {(f"node{i}", str(i)) for i in range(NODES)}, done.stdout


def test_sbatch_tasks_init_distributed_and_all_reduce(lay: sandbox.Layout) -> None:
    shared = Path(lay.shared)
    (shared / "slurm_train.py").write_text(TRAIN)
    out = shared / "slurm.out"
    out.unlink(missing_ok=True)
    reports = shared / "slurm-results"
    shutil.rmtree(reports, ignore_errors=True)
    reports.mkdir()
    batch = shared / "slurm.sbatch"
    batch.write_text(
        "#!/bin/sh\n"
        f"#SBATCH --nodes={NODES} --ntasks-per-node=2 --chdir=/ --output={out}\n"
        f"srun {sys.executable} {shared / 'slurm_train.py'} {reports}\n"
    )
    done = in_node(lay, ["sbatch", "--parsable", "--wait", str(batch)], node=2)
    text = out.read_text() if out.exists() else ""
    assert done.returncode == 0, done.stdout + done.stderr + text
    results = [p.read_text().split() for p in reports.iterdir()]
    world = NODES * 2
    assert len(results) == world, text
    assert sorted(int(r[2]) for r in results) == list(range(world))
    assert {float(r[4]) for r in results} == {float(world * (world + 1) // 2)}
    assert {r[1] for r in results if int(r[2]) < 2} == {"node0"}  # rank 0 and the store on node0


def test_reboot_brings_slurmd_back(lay: sandbox.Layout) -> None:
    sandbox.reboot(lay, 3)
    deadline = time.monotonic() + 60
    while "node3" not in slurm.idle_nodes(lay) and time.monotonic() < deadline:
        time.sleep(0.5)
    done = in_node(lay, ["srun", "-N4", "--chdir=/", "hostname"])
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(done.stdout.split()) == [n.name for n in lay.nodes], done.stdout + done.stderr
