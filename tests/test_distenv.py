import shlex
import subprocess

import pytest

from meshkit.distenv import (
    DistEnvError,
    NodeEnv,
    as_json,
    combine,
    export_lines,
    master_problem,
    process_place,
    variables,
)
from meshkit.hostfile import parse
from meshkit.record import replace
from meshkit.sources import Placement
from meshkit.topology import Match

# The exported names, in their order (DESIGN's names; meshkit.distenv.variables makes them).
VARIABLES = (
    "NODE_RANK",
    "NNODES",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GPUS_PER_NODE",
    "NPROC_PER_NODE",
    "WORLD_SIZE",
    "PET_NNODES",
    "PET_NODE_RANK",
    "PET_MASTER_ADDR",
    "PET_MASTER_PORT",
    "PET_NPROC_PER_NODE",
    "GLOO_SOCKET_IFNAME",
    "NCCL_SOCKET_IFNAME",
)
HOSTS = parse("10.0.0.1 slots=2\n10.0.0.2 slots=2\n10.0.0.3 slots=2\n")


def env_for(rank, **kw):
    return combine(
        None,
        HOSTS,
        Match(rank, f"10.0.0.{rank + 1}", "eth0"),
        session="s",
        master_port=kw.get("port"),
        nproc_per_node=kw.get("nproc"),
        gpu_count=lambda: 0,
    )


def test_every_simulated_node_agrees_on_everything_but_its_rank():
    envs = [env_for(rank) for rank in range(3)]
    assert [env.node_rank for env in envs] == [0, 1, 2]
    shared = {(env.nnodes, env.master_addr, env.master_port, env.nproc_per_node) for env in envs}
    assert len(shared) == 1
    assert envs[0].master_addr == "10.0.0.1"
    assert envs[0].world_size == 6


def test_precedence_flag_then_launcher_then_hostfile_then_gpus():
    assert env_for(0, port=29500, nproc=8).master_port == 29500
    assert env_for(0, nproc=8).nproc_per_node == 8
    no_slots = parse("a\nb\n")
    node_env = combine(
        None,
        no_slots,
        Match(1, "b", "eth0"),
        session="s",
        master_port=None,
        nproc_per_node=None,
        gpu_count=lambda: 4,
    )
    assert node_env.nproc_per_node == 4
    node_env = combine(
        None,
        no_slots,
        Match(1, "b", "eth0"),
        session="s",
        master_port=None,
        nproc_per_node=None,
        gpu_count=lambda: 0,
    )
    assert node_env.nproc_per_node == 1
    slurm = Placement(
        "slurm", 1, nnodes=2, master_addr="gpu07", master_port=None, nproc_per_node=None
    )
    node_env = combine(
        slurm, None, None, session="s", master_port=None, nproc_per_node=None, gpu_count=lambda: 2
    )
    assert (node_env.master_addr, node_env.nnodes, node_env.nproc_per_node, node_env.source) == (
        "gpu07",
        2,
        2,
        "slurm",
    )


def test_rank_outside_node_count_is_an_error():
    with pytest.raises(DistEnvError, match=r"outside 0\.\.2"):
        combine(
            Placement("explicit", 5),
            HOSTS,
            None,
            session="s",
            master_port=None,
            nproc_per_node=None,
            gpu_count=lambda: 0,
        )


def test_exports_are_eval_safe_and_complete():
    node_env = NodeEnv(0, 1, "host'; touch /tmp/pwned; '", 1234, 1, "explicit", "x")
    out = subprocess.run(
        ["bash", "-c", export_lines(node_env) + '\nprintf %s "$MASTER_ADDR"'],
        capture_output=True,
        text=True,
    )
    assert out.stdout == "host'; touch /tmp/pwned; '"
    node_env = replace(
        node_env, socket_ifnames=(("GLOO_SOCKET_IFNAME", "ens3"), ("NCCL_SOCKET_IFNAME", "ens3"))
    )
    assert list(variables(node_env)) == list(VARIABLES)
    assert set(as_json(node_env)) == {*VARIABLES, "source", "matched", "interface_source"}
    assert shlex.split(export_lines(env_for(1)).splitlines()[0]) == ["export", "NODE_RANK=1"]
    exported = variables(env_for(2))
    assert (
        exported["PET_NODE_RANK"],
        exported["PET_NNODES"],
        exported["PET_NPROC_PER_NODE"],
        exported["WORLD_SIZE"],
    ) == (
        "2",
        "3",
        "2",
        "6",
    )
    assert exported["GPUS_PER_NODE"] == exported["NPROC_PER_NODE"] == "2"


def test_process_place_from_each_launcher():
    node_env = env_for(1)
    assert process_place(node_env, {"RANK": "3", "WORLD_SIZE": "6", "LOCAL_RANK": "1"}).rank == 3
    assert process_place(node_env, {}).rank == 2
    assert process_place(node_env, {"LOCAL_RANK": "1"}).rank == 3


def openmpi_env(node_rank: int) -> NodeEnv:
    """What node ``node_rank`` of HOSTS computes under mpirun -npernode 2 with the hostfile."""
    placement = Placement(
        "openmpi",
        None,
        nproc_per_node=2,
        matched="OMPI_COMM_WORLD_RANK // OMPI_COMM_WORLD_LOCAL_SIZE",
        hostfile_decides=True,
        world_size=6,
        verify_master=True,
    )
    return combine(
        placement,
        HOSTS,
        Match(node_rank, f"10.0.0.{node_rank + 1}", "eth0"),
        session="s",
        master_port=None,
        nproc_per_node=None,
        gpu_count=lambda: 0,
    )


def test_openmpi_with_a_hostfile_the_hostfile_decides_node_rank_and_master():
    envs = [openmpi_env(r) for r in range(3)]
    assert [env.node_rank for env in envs] == [0, 1, 2]
    assert {
        (node_env.nnodes, node_env.master_addr, node_env.nproc_per_node, node_env.source)
        for node_env in envs
    } == {(3, "10.0.0.1", 2, "openmpi")}
    assert envs[2].matched == (
        "10.0.0.3 on eth0 (hostfile node 2); NPROC_PER_NODE from OMPI_COMM_WORLD_LOCAL_SIZE"
    )


def test_openmpi_process_count_must_fit_the_hostfile():
    placement = Placement("openmpi", None, nproc_per_node=1, hostfile_decides=True, world_size=2)
    with pytest.raises(
        DistEnvError, match="runs 2 processes, 1 on this node, but the hostfile lists 3"
    ):
        combine(
            placement,
            HOSTS,
            Match(0, "10.0.0.1", "eth0"),
            session="s",
            master_port=None,
            nproc_per_node=None,
            gpu_count=lambda: 0,
        )


def test_openmpi_without_hostfile_reports_what_is_needed():
    placement = Placement(
        "openmpi",
        None,
        nproc_per_node=2,
        hostfile_decides=True,
        problem="Open MPI: MASTER_ADDR is not set",
    )
    with pytest.raises(DistEnvError, match="MASTER_ADDR is not set"):
        combine(
            placement,
            None,
            None,
            session="s",
            master_port=None,
            nproc_per_node=None,
            gpu_count=lambda: 0,
        )


def test_launcher_processes_get_the_node_block_whatever_the_launch_order():
    # mpirun -H in reverse hostfile order: OMPI rank 0 runs on node 2. The torch rank follows the
    # node rank, so rank 0 is on the master node, and every rank appears once.
    ranks = []
    for node in range(3):
        node_env = openmpi_env(node)
        for local in range(2):
            omp = 6 - 2 * (node + 1) + local
            place = process_place(
                node_env,
                {
                    "OMPI_COMM_WORLD_RANK": str(omp),
                    "OMPI_COMM_WORLD_SIZE": "6",
                    "OMPI_COMM_WORLD_LOCAL_RANK": str(local),
                },
            )
            assert place.world_size == 6
            assert place.local_rank == local
            ranks.append(place.rank)
    assert ranks == [0, 1, 2, 3, 4, 5]
    slurm = replace(env_for(1), source="slurm")
    assert (
        process_place(slurm, {"SLURM_PROCID": "1", "SLURM_NTASKS": "6", "SLURM_LOCALID": "1"}).rank
        == 3
    )
    with pytest.raises(DistEnvError, match="SLURM_NTASKS=4 but 3 nodes x 2 processes make 6"):
        process_place(slurm, {"SLURM_NTASKS": "4", "SLURM_LOCALID": "0"})
    with pytest.raises(DistEnvError, match="SLURM_LOCALID=2 but this node runs 2 processes"):
        process_place(slurm, {"SLURM_NTASKS": "6", "SLURM_LOCALID": "2"})


def test_master_must_be_this_node_exactly_when_this_is_node_0():
    def place(rank: int) -> Placement:
        return Placement("openmpi", rank, nnodes=2, master_addr="m", matched="OMPI")

    assert master_problem(place(0), ["10.0.0.1"], ["10.0.0.1", "127.0.0.1"]) is None
    assert master_problem(place(1), ["10.0.0.1"], ["10.0.0.2"]) is None
    assert "is this machine, but openmpi makes it node 1" in str(
        master_problem(place(1), ["10.0.0.1"], ["10.0.0.1"])
    )
    assert "is not this machine, but openmpi makes this node 0" in str(
        master_problem(place(0), ["10.0.0.1"], ["10.0.0.2"])
    )
    assert "loopback" in str(master_problem(place(0), ["127.0.0.1"], ["127.0.0.1"]))
    assert master_problem(place(0), [], ["10.0.0.2"]) is None  # unresolvable: nothing to compare
