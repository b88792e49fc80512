"""A scheduler source on real-world networks: under real SLURM (``sandbox.up --slurm``), with
interface names that differ per node and Debian's ``127.0.1.1 <hostname>`` line, every node
exports its own interface, the one its route to MASTER_ADDR leaves from, never loopback."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator

import pytest
from conftest import fresh_sandbox, sandbox_name

from meshkit import sandbox
from meshkit.sandbox import networks, slurm

NAME = sandbox_name(__name__)
JOB_TIMEOUT = 300.0  # a bound, not a speed check
IFNAMES = ["eth0", "ens3", "eno1"]


@pytest.fixture(scope="module")
def lay() -> Iterator[sandbox.Layout]:
    opts = networks.NetworkOptions(ifnames=True, debian_hosts=True, second=True)
    with fresh_sandbox(NAME, 3, slurm=True, networks=opts) as layout:
        yield layout


def test_srun_each_node_exports_the_interface_of_its_route_to_the_master(lay):
    argv = ["srun", "-N3", "--chdir=/", sys.executable, "-m", "meshkit", "env", "--json"]
    done = sandbox.node_exec(
        lay.nodes[1],
        ["env", f"SLURM_CONF={slurm.conf_path(lay)}", "timeout", str(int(JOB_TIMEOUT)), *argv],
        timeout=JOB_TIMEOUT + 10,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    got = {
        int(g["NODE_RANK"]): g
        for g in (json.loads(line) for line in done.stdout.splitlines() if line.startswith("{"))
    }
    assert sorted(got) == [0, 1, 2]
    master = lay.nodes[0].address
    for rank, found in got.items():
        assert found["source"] == "slurm"
        assert found["MASTER_ADDR"] == "node0"
        assert found["GLOO_SOCKET_IFNAME"] == found["NCCL_SOCKET_IFNAME"] == IFNAMES[rank]
        # on node0, "node0" is 127.0.1.1 first: skipped, its real address decides
        assert found["interface_source"] == (
            f"route: MASTER_ADDR node0 ({master}) is reached from "
            f"{lay.nodes[rank].address} on {IFNAMES[rank]}"
        ), found
