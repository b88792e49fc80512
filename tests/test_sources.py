import pytest

from meshkit.errors import SourceError
from meshkit.sources import from_environment


def test_nothing_means_hostfile():
    assert from_environment({"PATH": "/bin"}) is None


def test_explicit_wins_over_everything():
    placement = from_environment(
        {"MESHKIT_NODE_RANK": "2", "SLURM_NODEID": "0", "GROUP_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    )
    assert (placement.source, placement.node_rank) == ("explicit", 2)


def test_torchrun_worker():
    placement = from_environment(
        {
            "GROUP_RANK": "1",
            "GROUP_WORLD_SIZE": "3",
            "LOCAL_WORLD_SIZE": "2",
            "TORCHELASTIC_RUN_ID": "x",
            "MASTER_ADDR": "10.0.0.1",
            "MASTER_PORT": "29500",
        }
    )
    assert (
        placement.source,
        placement.node_rank,
        placement.nnodes,
        placement.nproc_per_node,
        placement.master_addr,
        placement.master_port,
    ) == (
        "torchrun",
        1,
        3,
        2,
        "10.0.0.1",
        29500,
    )


def test_slurm_with_nodelist_expansion():
    placement = from_environment(
        {
            "SLURM_NODEID": "2",
            "SLURM_NNODES": "4",
            "SLURM_JOB_NODELIST": "gpu[07-09],gpu11",
            "SLURM_NTASKS_PER_NODE": "8(x4)",
        }
    )
    assert (
        placement.source,
        placement.node_rank,
        placement.nnodes,
        placement.master_addr,
        placement.nproc_per_node,
    ) == (
        "slurm",
        2,
        4,
        "gpu07",
        8,
    )


def test_slurm_bad_values_are_clear():
    with pytest.raises(SourceError, match="SLURM_NODEID='x' is not a whole number"):
        from_environment({"SLURM_NODEID": "x"})
    with pytest.raises(SourceError, match="SLURM_JOB_NODELIST"):
        from_environment({"SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "n[3-1]"})


def ompi(rank: int, size: int, local_size: int, local_rank: int, **extra: str) -> dict[str, str]:
    """The variables real mpirun (Open MPI 4) sets for one process."""
    return {
        "OMPI_COMM_WORLD_RANK": str(rank),
        "OMPI_COMM_WORLD_SIZE": str(size),
        "OMPI_COMM_WORLD_LOCAL_SIZE": str(local_size),
        "OMPI_COMM_WORLD_LOCAL_RANK": str(local_rank),
        "OMPI_COMM_WORLD_NODE_RANK": str(local_rank),  # index on the node: never the node's
        **extra,
    }


def test_openmpi_without_hostfile_derives_the_node_from_blocks():
    # 2 nodes x 4 processes in blocks (-npernode 4): rank 5 is the second process of node 1.
    placement = from_environment(
        ompi(5, 8, 4, 1, MASTER_ADDR="10.0.0.1", OMPI_MCA_orte_num_nodes="2")
    )
    assert placement is not None
    assert (
        placement.source,
        placement.node_rank,
        placement.nnodes,
        placement.nproc_per_node,
        placement.master_addr,
    ) == (
        "openmpi",
        1,
        2,
        4,
        "10.0.0.1",
    )
    assert placement.matched == "OMPI_COMM_WORLD_RANK // OMPI_COMM_WORLD_LOCAL_SIZE = 5 // 4"
    assert placement.hostfile_decides
    assert placement.verify_master
    assert placement.world_size == 8
    # every process of that node agrees, whatever its index on the node
    assert {
        from_environment(ompi(r, 8, 4, r - 4, MASTER_ADDR="m")).node_rank for r in range(4, 8)
    } == {1}  # type: ignore[union-attr]


def test_openmpi_refuses_what_it_cannot_derive_and_says_what_is_needed():
    cases = {
        "MASTER_ADDR is not set": ompi(0, 4, 2, 0),
        "uneven placement: 4 processes on 2 nodes, 3 on this node": ompi(
            0, 4, 3, 0, MASTER_ADDR="m", OMPI_MCA_orte_num_nodes="2"
        ),
        # 3 on one node, 1 on the other: the lone process's node cannot be told from its rank
        "uneven placement: 4 processes on 2 nodes, 1 on this node": ompi(
            3, 4, 1, 0, MASTER_ADDR="m", OMPI_MCA_orte_num_nodes="2"
        ),
        "not one block": ompi(1, 4, 2, 0, MASTER_ADDR="m"),  # --map-by node
        # rank 0 looks like a block on its own; mpirun's mapping option says it is not
        "(--map-by node interleaves": ompi(
            0, 4, 2, 0, MASTER_ADDR="m", OMPI_MCA_rmaps_base_mapping_policy="node"
        ),
        "(--rank-by node interleaves": ompi(
            0, 4, 2, 0, MASTER_ADDR="m", OMPI_MCA_rmaps_base_ranking_policy="node:span"
        ),
    }
    for why, env in cases.items():
        placement = from_environment(env)
        assert placement is not None
        assert placement.node_rank is None
        assert placement.problem is not None
        assert why in placement.problem
        assert "--hostfile" in placement.problem
        assert "MASTER_ADDR" in placement.problem


def test_openmpi_half_set_is_an_error():
    with pytest.raises(SourceError, match="OMPI_COMM_WORLD_LOCAL_RANK is not"):
        from_environment(
            {
                "OMPI_COMM_WORLD_RANK": "0",
                "OMPI_COMM_WORLD_SIZE": "2",
                "OMPI_COMM_WORLD_LOCAL_SIZE": "1",
            }
        )


def test_pbs_nodefile_by_hostname():
    nodefile = "n1.cl\nn1.cl\nn2.cl\nn2.cl\nn3.cl\nn3.cl\n"
    placement = from_environment({"PBS_NODEFILE": "/x", "MESHKIT_HOSTNAME": "n2"}, nodefile)
    assert placement is not None
    assert (
        placement.source,
        placement.node_rank,
        placement.nnodes,
        placement.nproc_per_node,
        placement.master_addr,
    ) == (
        "pbs",
        1,
        3,
        2,
        "n1.cl",
    )
    assert not placement.verify_master  # the nodefile's first node is both node 0 and the master
    with pytest.raises(SourceError, match="does not list this host"):
        from_environment({"PBS_NODEFILE": "/x", "MESHKIT_HOSTNAME": "zz"}, nodefile)


def test_pbs_refuses_uneven_slots_and_checks_a_user_master():
    with pytest.raises(SourceError, match=r"uneven slots per node \(a: 2, b: 1\)"):
        from_environment({"PBS_NODEFILE": "/x", "MESHKIT_HOSTNAME": "b"}, "a\na\nb\n")
    placement = from_environment(
        {"PBS_NODEFILE": "/x", "MESHKIT_HOSTNAME": "b", "MASTER_ADDR": "10.0.0.9"}, "a\nb\n"
    )
    assert placement is not None
    assert placement.master_addr == "10.0.0.9"
    assert placement.verify_master


def test_order_torchrun_before_slurm_before_openmpi():
    env = {"SLURM_NODEID": "1", "SLURM_NNODES": "2", "OMPI_COMM_WORLD_RANK": "0"}
    assert from_environment(env).source == "slurm"
    env |= {"GROUP_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    assert from_environment(env).source == "torchrun"


def test_slurm_step_tasks_win_and_uneven_tasks_are_refused():
    env = {"SLURM_NODEID": "1", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "n[1-2]"}
    placement = from_environment(
        env | {"SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_STEP_TASKS_PER_NODE": "2(x2)"}
    )
    assert placement is not None
    assert placement.nproc_per_node == 2
    assert placement.master_addr == "n1"
    with pytest.raises(SourceError, match=r"SLURM_TASKS_PER_NODE='2\(x1\),1': nodes run different"):
        from_environment(env | {"SLURM_TASKS_PER_NODE": "2(x1),1"})
