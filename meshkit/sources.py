"""Placement given by whatever launched us (torchrun, SLURM, OpenMPI, PBS, or the user), read from
environment variables. Pure: the caller passes the environment and the PBS nodefile's text."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import hostlist

from .errors import SourceError


@dataclass(frozen=True)
class Placement:
    """What a launcher says about this node; ``None`` fields are filled from the hostfile/config."""

    source: str
    node_rank: int
    nnodes: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    nproc_per_node: int | None = None
    matched: str | None = None


def _int(env: Mapping[str, str], name: str, low: int = 0) -> int | None:
    if name not in env:
        return None
    value = env[name].strip()
    if not value.isdigit() or int(value) < low:
        raise SourceError(f"{name}={env[name]!r} is not a whole number >= {low}; fix or unset it")
    return int(value)


def explicit(env: Mapping[str, str], _nodefile: str | None = None) -> Placement | None:
    rank = _int(env, "MESHKIT_NODE_RANK")
    if rank is None:
        return None
    return Placement("explicit", rank, matched="MESHKIT_NODE_RANK")


def torchrun(env: Mapping[str, str], _nodefile: str | None = None) -> Placement | None:
    rank = _int(env, "GROUP_RANK")
    if rank is None or ("TORCHELASTIC_RUN_ID" not in env and "LOCAL_WORLD_SIZE" not in env):
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


def _tasks_per_node(text: str) -> int | None:
    """SLURM_NTASKS_PER_NODE / SLURM_TASKS_PER_NODE look like ``4`` or ``4(x3),2``; take the first."""
    found = re.match(r"^(\d+)", text.strip())
    return int(found.group(1)) if found else None


def slurm(env: Mapping[str, str], _nodefile: str | None = None) -> Placement | None:
    rank = _int(env, "SLURM_NODEID")
    if rank is None:
        return None
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
    try:
        nodes = hostlist.expand_hostlist(nodelist) if nodelist else []
    except hostlist.BadHostlist as exc:
        raise SourceError(
            f"SLURM_JOB_NODELIST={nodelist!r} is not a valid node list: {exc}"
        ) from None
    nnodes = (
        _int(env, "SLURM_NNODES", 1) or _int(env, "SLURM_JOB_NUM_NODES", 1) or (len(nodes) or None)
    )
    per_node = env.get("SLURM_NTASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or ""
    return Placement(
        "slurm",
        rank,
        nnodes=nnodes,
        master_addr=env.get("MASTER_ADDR") or (nodes[0] if nodes else None),
        master_port=_int(env, "MASTER_PORT", 1),
        nproc_per_node=_tasks_per_node(per_node) or _int(env, "SLURM_GPUS_ON_NODE", 1),
        matched="SLURM_NODEID",
    )


def openmpi(env: Mapping[str, str], _nodefile: str | None = None) -> Placement | None:
    rank = _int(env, "OMPI_COMM_WORLD_RANK")
    if rank is None:
        return None
    size = _int(env, "OMPI_COMM_WORLD_SIZE", 1) or 1
    local_size = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", 1) or 1
    node_rank = _int(env, "OMPI_COMM_WORLD_NODE_RANK")
    return Placement(
        "openmpi",
        rank // local_size if node_rank is None else node_rank,
        nnodes=max(1, size // local_size),
        master_addr=env.get("MASTER_ADDR"),
        master_port=_int(env, "MASTER_PORT", 1),
        nproc_per_node=local_size,
        matched="OMPI_COMM_WORLD_RANK",
    )


def pbs(env: Mapping[str, str], nodefile: str | None = None) -> Placement | None:
    """PBS lists one line per slot; nodes are the distinct lines in order. Needs ``hostname`` in env
    as ``MESHKIT_HOSTNAME`` (the caller supplies it) to find our place."""
    if "PBS_NODEFILE" not in env or nodefile is None:
        return None
    lines = [line.strip() for line in nodefile.splitlines() if line.strip()]
    nodes = list(dict.fromkeys(lines))
    me = env.get("MESHKIT_HOSTNAME", "")
    short = [n.split(".", 1)[0] for n in nodes]
    if me in nodes:
        rank = nodes.index(me)
    elif me.split(".", 1)[0] in short:
        rank = short.index(me.split(".", 1)[0])
    else:
        raise SourceError(
            f"PBS_NODEFILE={env['PBS_NODEFILE']} does not list this host ({me}); it lists {', '.join(nodes)}"
        )
    return Placement(
        "pbs",
        rank,
        nnodes=len(nodes),
        master_addr=env.get("MASTER_ADDR") or nodes[0],
        master_port=_int(env, "MASTER_PORT", 1),
        nproc_per_node=lines.count(nodes[rank]),
        matched=f"PBS_NODEFILE:{nodes[rank]}",
    )


SOURCES: tuple[Callable[[Mapping[str, str], str | None], Placement | None], ...] = (
    explicit,
    torchrun,
    slurm,
    openmpi,
    pbs,
)


def from_environment(env: Mapping[str, str], nodefile: str | None = None) -> Placement | None:
    """The first source (in DESIGN order) whose variables are present, or ``None`` for the hostfile."""
    for source in SOURCES:
        placement = source(env, nodefile)
        if placement is not None:
            return placement
    return None
