"""The node environment and the variables exported from it. Pure; never imports torch."""

from __future__ import annotations

import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from .errors import DistEnvError
from .hostfile import Host
from .sources import Placement
from .topology import Match, derive_master_port, master_addr

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


@dataclass(frozen=True)
class NodeEnv:
    """Where this node sits in the job: the same on every node except ``node_rank``/``matched``."""

    node_rank: int
    nnodes: int
    master_addr: str
    master_port: int
    nproc_per_node: int
    source: str
    matched: str
    # GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME -> interface: differs per node (eno1 here, eth0 there)
    socket_ifnames: tuple[tuple[str, str], ...] = ()
    interface_source: str = ""  # why that interface (or why none)

    def __post_init__(self) -> None:
        if not 0 <= self.node_rank < self.nnodes:
            raise DistEnvError(
                f"node rank {self.node_rank} is outside 0..{self.nnodes - 1} ({self.source}); "
                "check the rank source and the node count"
            )
        if not 1 <= self.master_port <= 65535:
            raise DistEnvError(f"master port {self.master_port} is not 1..65535")

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node


def variables(env: NodeEnv) -> dict[str, str]:
    """Every exported variable, so both ``run.sh $GPUS_PER_NODE ...`` and a bare ``torchrun`` work."""
    plain = {
        "NODE_RANK": env.node_rank,
        "NNODES": env.nnodes,
        "MASTER_ADDR": env.master_addr,
        "MASTER_PORT": env.master_port,
        "GPUS_PER_NODE": env.nproc_per_node,
        "NPROC_PER_NODE": env.nproc_per_node,
        "WORLD_SIZE": env.world_size,
    }
    torchrun = {
        f"PET_{k}": plain[k]
        for k in ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "NPROC_PER_NODE")
    }
    return {k: str(v) for k, v in {**plain, **torchrun, **dict(env.socket_ifnames)}.items()}


def export_lines(env: NodeEnv) -> str:
    """``export K=V`` lines, values shell-quoted so the output is safe to ``eval``."""
    return "\n".join(f"export {k}={shlex.quote(v)}" for k, v in variables(env).items())


def as_json(env: NodeEnv) -> dict[str, object]:
    out: dict[str, object] = dict(variables(env))
    out["source"] = env.source
    out["matched"] = env.matched
    out["interface_source"] = env.interface_source
    return out


def torchrun_argv(env: NodeEnv, script: list[str]) -> list[str]:
    """The explicit torchrun command the seed-style ``run.sh`` builds."""
    return [
        "torchrun",
        f"--nproc-per-node={env.nproc_per_node}",
        f"--nnodes={env.nnodes}",
        f"--node-rank={env.node_rank}",
        f"--master-addr={env.master_addr}",
        f"--master-port={env.master_port}",
        *script,
    ]


@dataclass(frozen=True)
class ProcessPlace:
    rank: int
    world_size: int
    local_rank: int


def process_place(env: NodeEnv, environ: Mapping[str, str]) -> ProcessPlace:
    """This process's global rank: from torchrun/SLURM/OpenMPI per-process variables when present,
    else the node's first process (``LOCAL_RANK`` picks another)."""
    for rank_key, size_key, local_key in (
        ("RANK", "WORLD_SIZE", "LOCAL_RANK"),
        ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ):
        if rank_key in environ and size_key in environ:
            return ProcessPlace(
                int(environ[rank_key]), int(environ[size_key]), int(environ.get(local_key, "0"))
            )
    local = int(environ.get("LOCAL_RANK", "0"))
    return ProcessPlace(env.node_rank * env.nproc_per_node + local, env.world_size, local)


def combine(
    placement: Placement | None,
    hosts: Sequence[Host] | None,
    match: Match | None,
    *,
    session: str,
    master_port: int | None,
    nproc_per_node: int | None,
    gpu_count: Callable[[], int],
) -> NodeEnv:
    """Fill a launcher's placement (or a hostfile match) into a complete ``NodeEnv``. Precedence for
    each value: flag/config, then the launcher, then the hostfile, then this machine."""
    if placement is None:
        if hosts is None or match is None:
            raise DistEnvError(
                "no launcher variables and no hostfile: pass --hostfile or set MESHKIT_NODE_RANK"
            )
        placement = Placement("hostfile", match.rank, matched=match.describe())
    nnodes = placement.nnodes or (len(hosts) if hosts else None)
    addr = placement.master_addr or (master_addr(hosts) if hosts else None)
    if nnodes is None or addr is None:
        raise DistEnvError(
            f"{placement.source} gives no node count or master address and there is no hostfile; "
            "pass --hostfile (or set MASTER_ADDR)"
        )
    slots = hosts[0].slots if hosts else None
    port = master_port or placement.master_port
    if port is None:
        port = derive_master_port(
            hosts or [Host(addr)], f"{session}/{nnodes}" if not hosts else session
        )
    return NodeEnv(
        node_rank=placement.node_rank,
        nnodes=nnodes,
        master_addr=addr,
        master_port=port,
        nproc_per_node=nproc_per_node or placement.nproc_per_node or slots or gpu_count() or 1,
        source=placement.source,
        matched=placement.matched or placement.source,
    )
