"""Placement given by whatever launched us (torchrun, SLURM, OpenMPI, PBS, or the user), read from
environment variables. Pure: the caller passes the environment and the PBS nodefile's text."""

from __future__ import annotations

from collections.abc import Mapping

from .errors import SourceError
from .record import record


@record
class Placement:
    """What a launcher says about this node; ``None`` fields are filled from the hostfile/config.

    ``node_rank`` is ``None`` when the launcher cannot say which node this is by itself (OpenMPI
    with uneven or interleaved placements): then only a hostfile can, and ``problem`` says why the
    launcher alone is not enough. ``hostfile_decides``: a hostfile, when there is one, decides the
    node rank and master, and the launcher only says how many processes run here (OpenMPI).
    ``world_size`` is the launcher's process count, checked against nodes x processes per node.
    ``verify_master``: the master address came from outside the launcher's own node list (the
    user's ``MASTER_ADDR``), so discovery checks that it names this node exactly when this is node
    0."""

    source: str
    node_rank: int | None
    nnodes: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    nproc_per_node: int | None = None
    matched: str | None = None
    hostfile_decides: bool = False
    problem: str | None = None
    world_size: int | None = None
    verify_master: bool = False


def _int(env: Mapping[str, str], name: str, low: int = 0) -> int | None:
    if name not in env:
        return None
    value = env[name].strip()
    is_number = value.isascii() and value.isdigit()
    if not is_number or int(value) < low:
        raise SourceError(f"{name}={env[name]!r} is not a whole number >= {low}; fix or unset it")
    return int(value)


def explicit(env: Mapping[str, str], _nodefile: str | None = None) -> Placement | None:
    rank = _int(env, "MESHKIT_NODE_RANK")
    if rank is None:
        return None
    return Placement("explicit", rank, matched="MESHKIT_NODE_RANK")


def torchrun(env: Mapping[str, str], _nodefile: str | None = None) -> Placement | None:
    rank = _int(env, "GROUP_RANK")
    if rank is None:
        return None
    if "TORCHELASTIC_RUN_ID" not in env and "LOCAL_WORLD_SIZE" not in env:
        return None
    return Placement(
        "torchrun",
        rank,
        nnodes=_int(env, "GROUP_WORLD_SIZE", 1),
        master_addr=env.get("MASTER_ADDR"),
        master_port=_int(env, "MASTER_PORT", 1),
        nproc_per_node=_int(env, "LOCAL_WORLD_SIZE", 1),
        matched="GROUP_RANK",
    )


def _tasks_per_node(name: str, text: str) -> int | None:
    """SLURM's tasks per node look like ``4`` or ``4(x3),2``: every node must run the same count
    (NPROC_PER_NODE is one number), so ``4(x3),2`` is refused."""
    import re  # SLURM only: `meshkit run` from a hostfile skips re (and hostlist below)

    counts = set(re.findall(r"(\d+)(?:\(x\d+\))?", text.strip()))
    if len(counts) > 1:
        raise SourceError(
            f"{name}={text!r}: nodes run different numbers of tasks; run the same number on "
            "every node (srun --ntasks-per-node=N)"
        )
    if not counts:
        return None
    return int(counts.pop())


# The step's own tasks first: inside an sbatch allocation, srun may start fewer per node.
SLURM_TASKS_PER_NODE = (
    "SLURM_STEP_TASKS_PER_NODE",
    "SLURM_NTASKS_PER_NODE",
    "SLURM_TASKS_PER_NODE",
)


def slurm(env: Mapping[str, str], _nodefile: str | None = None) -> Placement | None:
    """SLURM numbers nodes in ``SLURM_JOB_NODELIST`` order, so its first node is node 0 and the
    master unless the user set ``MASTER_ADDR`` (then checked against this node)."""
    rank = _int(env, "SLURM_NODEID")
    if rank is None:
        return None
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
    import hostlist

    nodes: list[str] = []
    if nodelist:
        try:
            nodes = hostlist.expand_hostlist(nodelist)
        except hostlist.BadHostlist as exc:
            raise SourceError(
                f"SLURM_JOB_NODELIST={nodelist!r} is not a valid node list: {exc}"
            ) from None
    # The first of these that gives a count, else the node list's length.
    nnodes = _int(env, "SLURM_NNODES", 1)
    if not nnodes:
        nnodes = _int(env, "SLURM_JOB_NUM_NODES", 1)
    if not nnodes:
        nnodes = len(nodes) or None
    per_node_var = ""
    for name in SLURM_TASKS_PER_NODE:
        if env.get(name):
            per_node_var = name
            break
    master_addr = env.get("MASTER_ADDR") or None
    if master_addr is None and nodes:
        master_addr = nodes[0]
    master_port = _int(env, "MASTER_PORT", 1)
    nproc_per_node = _tasks_per_node(per_node_var, env.get(per_node_var, ""))
    if not nproc_per_node:
        nproc_per_node = _int(env, "SLURM_GPUS_ON_NODE", 1)
    return Placement(
        "slurm",
        rank,
        nnodes=nnodes,
        master_addr=master_addr,
        master_port=master_port,
        nproc_per_node=nproc_per_node,
        matched="SLURM_NODEID",
        verify_master=bool(env.get("MASTER_ADDR")),
    )


OPENMPI_NO_HOSTFILE = (
    "without a hostfile the node index is OMPI_COMM_WORLD_RANK // OMPI_COMM_WORLD_LOCAL_SIZE, "
    "which needs the same number of processes on every node, placed in blocks "
    "(mpirun -npernode N or --map-by slot) and MASTER_ADDR set to the node of rank 0; "
    "or pass --hostfile (the hostfile then decides node ranks and master)"
)


def _interleaving_policy(env: Mapping[str, str]) -> str | None:
    """The mpirun option that numbers ranks across nodes rather than in per-node blocks, if any
    (mpirun passes its mapping and ranking options to every process as MCA variables)."""
    mapping = env.get("OMPI_MCA_rmaps_base_mapping_policy", "").split(":", 1)[0].lower()
    ranking = env.get("OMPI_MCA_rmaps_base_ranking_policy", "").split(":", 1)[0].lower()
    if mapping in ("node", "seq", "dist"):
        return f"--map-by {mapping}"
    if ranking == "node":
        return "--rank-by node"
    if env.get("OMPI_MCA_rmaps_rank_file_path"):
        return "a rankfile"
    return None


def _openmpi_block_problem(
    env: Mapping[str, str],
    rank: int,
    size: int,
    local_size: int,
    local_rank: int,
    num_nodes: int | None,
) -> str | None:
    """Why the global rank cannot tell this node's index (``None`` when it can): the node index
    is ``rank // local_size`` only when every node runs ``local_size`` processes in one block."""
    uneven = size % local_size != 0
    if num_nodes is not None and num_nodes * local_size != size:
        uneven = True
    if uneven:
        nodes = ""
        if num_nodes is not None:
            nodes = f" on {num_nodes} nodes"
        return f"uneven placement: {size} processes{nodes}, {local_size} on this node"
    policy = _interleaving_policy(env)
    if policy is not None:
        return f"this node's ranks are not one block ({policy} interleaves them across nodes)"
    if rank % local_size != local_rank:
        return (
            f"this node's ranks are not one block (rank {rank} is local rank {local_rank} of "
            f"{local_size}; mpirun --map-by node interleaves them)"
        )
    return None


def openmpi(env: Mapping[str, str], _nodefile: str | None = None) -> Placement | None:
    """OpenMPI says how many processes run on this node (``OMPI_COMM_WORLD_LOCAL_SIZE``), never
    which node this is: ``OMPI_COMM_WORLD_NODE_RANK`` is the process's index *on* its node. So a
    hostfile, when there is one, decides the node rank and master (``hostfile_decides``); without
    one the node index is derived from the global rank, and only for placements where that is
    sound: the same local size everywhere and each node's ranks in one block."""
    rank = _int(env, "OMPI_COMM_WORLD_RANK")
    if rank is None:
        return None
    size = _int(env, "OMPI_COMM_WORLD_SIZE", 1)
    local_size = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", 1)
    local_rank = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK")
    num_nodes = _int(env, "OMPI_MCA_orte_num_nodes", 1)
    if size is None or local_size is None or local_rank is None:
        needed = (
            "OMPI_COMM_WORLD_SIZE",
            "OMPI_COMM_WORLD_LOCAL_SIZE",
            "OMPI_COMM_WORLD_LOCAL_RANK",
        )
        missing = ", ".join(name for name in needed if name not in env)
        raise SourceError(
            f"OMPI_COMM_WORLD_RANK is set but {missing} is not; "
            "run under mpirun (Open MPI) or unset OMPI_COMM_WORLD_RANK"
        )
    here = (
        f"OMPI_COMM_WORLD_RANK={rank} OMPI_COMM_WORLD_SIZE={size} "
        f"OMPI_COMM_WORLD_LOCAL_SIZE={local_size} OMPI_COMM_WORLD_LOCAL_RANK={local_rank}"
    )
    problem = _openmpi_block_problem(env, rank, size, local_size, local_rank, num_nodes)
    master = env.get("MASTER_ADDR") or None
    if problem is None and master is None:
        problem = "MASTER_ADDR is not set"
    node_rank = None
    full_problem = None
    if problem:
        full_problem = f"Open MPI: {problem} ({here}); {OPENMPI_NO_HOSTFILE}"
    else:
        node_rank = rank // local_size
    return Placement(
        "openmpi",
        node_rank,
        nnodes=size // local_size,
        master_addr=master,
        master_port=_int(env, "MASTER_PORT", 1),
        nproc_per_node=local_size,
        matched=f"OMPI_COMM_WORLD_RANK // OMPI_COMM_WORLD_LOCAL_SIZE = {rank} // {local_size}",
        hostfile_decides=True,
        problem=full_problem,
        world_size=size,
        verify_master=True,
    )


def pbs(env: Mapping[str, str], nodefile: str | None = None) -> Placement | None:
    """PBS lists one line per slot; nodes are the distinct lines in order, the first is node 0 and
    the master (unless the user set ``MASTER_ADDR``, then checked against this node). Needs
    ``hostname`` in env as ``MESHKIT_HOSTNAME`` (the caller supplies it) to find our place."""
    if "PBS_NODEFILE" not in env or nodefile is None:
        return None
    lines = [line.strip() for line in nodefile.splitlines() if line.strip()]
    nodes = list(dict.fromkeys(lines))
    this_host = env.get("MESHKIT_HOSTNAME", "")
    this_short_name = this_host.split(".", 1)[0]
    short_names = [node.split(".", 1)[0] for node in nodes]
    where = f"PBS_NODEFILE={env['PBS_NODEFILE']}"
    if this_host in nodes:
        rank = nodes.index(this_host)
    elif short_names.count(this_short_name) == 1:
        rank = short_names.index(this_short_name)
    elif this_short_name in short_names:
        raise SourceError(
            f"{where} lists several hosts named {this_short_name} in different domains; "
            f"this host is {this_host}"
        )
    else:
        raise SourceError(
            f"{where} does not list this host ({this_host}); it lists {', '.join(nodes)}"
        )
    counts = {node: lines.count(node) for node in nodes}
    if len(set(counts.values())) > 1:
        uneven = ", ".join(f"{node}: {count}" for node, count in counts.items())
        raise SourceError(
            f"{where}: uneven slots per node ({uneven}); every node needs the same number of "
            "processes (request select=N:ncpus=K:mpiprocs=K)"
        )
    return Placement(
        "pbs",
        rank,
        nnodes=len(nodes),
        master_addr=env.get("MASTER_ADDR") or nodes[0],
        master_port=_int(env, "MASTER_PORT", 1),
        nproc_per_node=counts[nodes[rank]],
        matched=f"PBS_NODEFILE:{nodes[rank]}",
        verify_master=bool(env.get("MASTER_ADDR")),
    )


# In DESIGN order; each: (environment, the PBS nodefile's text) -> its Placement, or None.
SOURCES = (explicit, torchrun, slurm, openmpi, pbs)


def from_environment(env: Mapping[str, str], nodefile: str | None = None) -> Placement | None:
    """The first source (in DESIGN order) whose variables are present, or ``None`` (then the
    hostfile decides)."""
    for source in SOURCES:
        placement = source(env, nodefile)
        if placement is not None:
            return placement
    return None
