import pytest

from meshkit.errors import SourceError
from meshkit.sources import from_environment


def test_nothing_means_hostfile():
    assert from_environment({"PATH": "/bin"}) is None


def test_explicit_wins_over_everything():
    p = from_environment(
        {"MESHKIT_NODE_RANK": "2", "SLURM_NODEID": "0", "GROUP_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    )
    assert (p.source, p.node_rank) == ("explicit", 2)


def test_torchrun_worker():
    p = from_environment(
        {
            "GROUP_RANK": "1",
            "GROUP_WORLD_SIZE": "3",
            "LOCAL_WORLD_SIZE": "2",
            "TORCHELASTIC_RUN_ID": "x",
            "MASTER_ADDR": "10.0.0.1",
            "MASTER_PORT": "29500",
        }
    )
    assert (p.source, p.node_rank, p.nnodes, p.nproc_per_node, p.master_addr, p.master_port) == (
        "torchrun",
        1,
        3,
        2,
        "10.0.0.1",
        29500,
    )


def test_slurm_with_nodelist_expansion():
    p = from_environment(
        {
            "SLURM_NODEID": "2",
            "SLURM_NNODES": "4",
            "SLURM_JOB_NODELIST": "gpu[07-09],gpu11",
            "SLURM_NTASKS_PER_NODE": "8(x4)",
        }
    )
    assert (p.source, p.node_rank, p.nnodes, p.master_addr, p.nproc_per_node) == (
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


def test_openmpi():
    p = from_environment(
        {
            "OMPI_COMM_WORLD_RANK": "5",
            "OMPI_COMM_WORLD_SIZE": "8",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
        }
    )
    assert (p.source, p.node_rank, p.nnodes, p.nproc_per_node, p.master_addr) == (
        "openmpi",
        1,
        2,
        4,
        None,
    )


def test_pbs_nodefile_by_hostname():
    nodefile = "n1.cl\nn1.cl\nn2.cl\nn2.cl\nn3.cl\nn3.cl\n"
    p = from_environment({"PBS_NODEFILE": "/x", "MESHKIT_HOSTNAME": "n2"}, nodefile)
    assert (p.source, p.node_rank, p.nnodes, p.nproc_per_node, p.master_addr) == (
        "pbs",
        1,
        3,
        2,
        "n1.cl",
    )
    with pytest.raises(SourceError, match="does not list this host"):
        from_environment({"PBS_NODEFILE": "/x", "MESHKIT_HOSTNAME": "zz"}, nodefile)


def test_order_torchrun_before_slurm_before_openmpi():
    env = {"SLURM_NODEID": "1", "SLURM_NNODES": "2", "OMPI_COMM_WORLD_RANK": "0"}
    assert from_environment(env).source == "slurm"
    env |= {"GROUP_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    assert from_environment(env).source == "torchrun"
