"""The node environment and the variables exported from it, and the environment a command runs
with. Pure; never imports torch."""

from __future__ import annotations

import os
import posixpath
from collections.abc import Callable, Mapping, Sequence

from .errors import DistEnvError
from .hostfile import Host
from .record import record, replace
from .sources import Placement
from .topology import Match, derive_master_port


@record
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
    """Every exported variable, so both ``run.sh $GPUS_PER_NODE ...`` and a bare ``torchrun``
    work."""
    plain = {
        "NODE_RANK": env.node_rank,
        "NNODES": env.nnodes,
        "MASTER_ADDR": env.master_addr,
        "MASTER_PORT": env.master_port,
        "GPUS_PER_NODE": env.nproc_per_node,
        "NPROC_PER_NODE": env.nproc_per_node,
        "WORLD_SIZE": env.world_size,
    }
    torchrun_names = ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "NPROC_PER_NODE")
    torchrun = {f"PET_{name}": plain[name] for name in torchrun_names}
    exported = {**plain, **torchrun, **dict(env.socket_ifnames)}
    return {name: str(value) for name, value in exported.items()}


# torch's flight recorder (gloo and NCCL in torch >= 2.7; NCCL's older name too): what each rank
# last entered, which diagnose reads; NCCL dumps it on a timeout. HOME is the job's home.
FLIGHT = {
    "TORCH_FR_BUFFER_SIZE": "2000",
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    "TORCH_FR_DUMP_TEMP_FILE": "HOME/flight/rank_",
    "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "HOME/flight/rank_",
}


@record
class RankRecording:
    """Where a job's ranks leave what ``meshkit diagnose`` reads: the rank hook's directory
    (``node/hook``, first on their PYTHONPATH), the directory the hook writes uncaught exceptions
    to, and the job's home, where torch's flight recorder dumps."""

    hook: str
    errors: str
    home: str


def environment(
    node: NodeEnv,
    environ: Mapping[str, str],
    interpreter: str,
    recording: RankRecording | None = None,
) -> dict[str, str]:
    """What a command on this node runs with: ``environ``, the node's variables, and the
    directory of ``interpreter`` first on PATH; a job's command (``recording``) also gets the
    rank hook and torch's flight recorder."""
    # Nodes share the venv path: make its tools (torchrun) reachable as if it were activated.
    path = os.pathsep.join([os.path.dirname(interpreter), environ.get("PATH", "")])
    env = {**environ, **variables(node), "PATH": path}
    if recording is not None:
        python_path = [recording.hook]
        if env.get("PYTHONPATH"):
            python_path.append(env["PYTHONPATH"])
        env["PYTHONPATH"] = os.pathsep.join(python_path)
        env["MESHKIT_ERRORS"] = recording.errors
        for name, value in FLIGHT.items():
            env.setdefault(name, value.replace("HOME", recording.home))
    return env


def rank_variables(env: NodeEnv, local_rank: int) -> dict[str, str]:
    """What torchrun gives each of its workers, for the ``local_rank``-th process ``meshkit run
    --spawn`` starts on this node: ranks in node blocks (rank 0 on the master node, where it hosts
    the rendezvous store under ``init_method="env://"``), and the sizes. ``WORLD_SIZE``,
    ``MASTER_ADDR`` and ``MASTER_PORT`` are already among ``variables``. Not the TORCHELASTIC_*
    variables: no elastic agent is there to answer to."""
    if not 0 <= local_rank < env.nproc_per_node:
        raise DistEnvError(f"local rank {local_rank} is outside 0..{env.nproc_per_node - 1}")
    rank = env.node_rank * env.nproc_per_node + local_rank
    values = {
        "RANK": rank,
        "LOCAL_RANK": local_rank,
        "GROUP_RANK": env.node_rank,
        "ROLE_RANK": rank,
        "ROLE_NAME": "default",
        "LOCAL_WORLD_SIZE": env.nproc_per_node,
        "GROUP_WORLD_SIZE": env.nnodes,
        "ROLE_WORLD_SIZE": env.world_size,
    }
    return {name: str(value) for name, value in values.items()}


def log_target(pattern: str, node_rank: str | int) -> str:
    """The node's log file: ``{rank}`` is replaced in the file name only (a directory may hold
    any characters)."""
    head, name = posixpath.split(pattern)
    return posixpath.join(head, name.replace("{rank}", str(node_rank)))


# What shlex.quote leaves bare (its `[^\w@%+=:,./-]` test, ASCII). shlex imports re, and re (with
# the enum and functools it brings) would be the largest import of `meshkit run` on every node.
_SAFE = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_@%+=:,./-")


def shell_quote(text: str) -> str:
    """``shlex.quote(text)``, the same string, without importing shlex."""
    if not text:
        return "''"
    if all(ch in _SAFE for ch in text):
        return text
    return "'" + text.replace("'", "'\"'\"'") + "'"


def logged(cmd: str, target: str) -> str:
    """``cmd`` with its output also appended to ``target``. A pipeline, not ``exec > >(tee ...)``:
    bash then waits for tee, so the log is complete by the time the exit code is recorded."""
    return f"{{ {cmd}\n}} 2>&1 | tee -a {shell_quote(target)}\nexit ${{PIPESTATUS[0]}}"


def export_lines(env: NodeEnv) -> str:
    """``export K=V`` lines, values shell-quoted so the output is safe to ``eval``."""
    lines = [f"export {name}={shell_quote(value)}" for name, value in variables(env).items()]
    return "\n".join(lines)


def as_json(env: NodeEnv) -> dict[str, str]:
    why = {"source": env.source, "matched": env.matched, "interface_source": env.interface_source}
    return {**variables(env), **why}


@record
class ProcessPlace:
    rank: int
    world_size: int
    local_rank: int


# The per-process variables of launchers that start every process themselves: the process's index
# on its node, and the launcher's total process count.
PER_NODE_VARIABLES = {"openmpi": "OMPI_COMM_WORLD_LOCAL_SIZE"}
LOCAL_RANK_VARIABLES = {
    "slurm": ("SLURM_LOCALID", "SLURM_NTASKS"),
    "openmpi": ("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_SIZE"),
}


def _index(environ: Mapping[str, str], name: str) -> int:
    value = environ[name].strip()
    is_number = value.isascii() and value.isdigit()
    if not is_number:
        raise DistEnvError(f"{name}={environ[name]!r} is not a whole number >= 0")
    return int(value)


def process_place(env: NodeEnv, environ: Mapping[str, str]) -> ProcessPlace:
    """This process's global rank. Under torchrun its ``RANK``. Under SLURM and OpenMPI the node's
    block: ``node_rank * nproc_per_node + local rank``, so that rank 0 runs on the master node
    whatever order the launcher numbered its processes in (``mpirun -H`` order, ``--distribution
    cyclic``), and every process agrees with ``meshkit env``. Else the node's first process
    (``LOCAL_RANK`` picks another)."""
    if "RANK" in environ and "WORLD_SIZE" in environ and "LOCAL_RANK" in environ:
        rank = _index(environ, "RANK")
        world_size = _index(environ, "WORLD_SIZE")
        local_rank = _index(environ, "LOCAL_RANK")
        return ProcessPlace(rank, world_size, local_rank)
    # Without a launcher's own pair, LOCAL_RANK picks the process and nothing checks the size.
    local_key = "LOCAL_RANK"
    size_key = ""
    if env.source in LOCAL_RANK_VARIABLES:
        local_key, size_key = LOCAL_RANK_VARIABLES[env.source]
    local = 0
    if local_key in environ:
        local = _index(environ, local_key)
    if local >= env.nproc_per_node:
        raise DistEnvError(
            f"{local_key}={local} but this node runs {env.nproc_per_node} processes "
            f"(NPROC_PER_NODE from {env.matched}); start {env.nproc_per_node} per node"
        )
    if size_key in environ and _index(environ, size_key) != env.world_size:
        raise DistEnvError(
            f"{size_key}={environ[size_key]} but {env.nnodes} nodes x {env.nproc_per_node} "
            f"processes make {env.world_size}; start the same number of processes on every node"
        )
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
    each value: flag/config, then the launcher, then the hostfile, then this machine. A launcher
    that only says how many processes run here (OpenMPI) leaves node rank, node count and master to
    the hostfile when there is one (``match`` is then this node's hostfile line)."""
    if placement is None:
        if hosts is None or match is None:
            raise DistEnvError(
                "no launcher variables and no hostfile: pass --hostfile or set MESHKIT_NODE_RANK"
            )
        placement = Placement("hostfile", match.rank, matched=match.describe())
    elif placement.hostfile_decides and hosts is not None:
        if match is None:
            raise DistEnvError(f"{placement.source}: the hostfile decides, but no line matched")
        placement = _hostfile_decides(placement, hosts, match)
    if placement.node_rank is None:
        raise DistEnvError(placement.problem or f"{placement.source} gives no node rank")
    nnodes = placement.nnodes
    if not nnodes:
        nnodes = None
        if hosts:
            nnodes = len(hosts)
    # The hostfile's first line, as written: a name stays a name.
    master_addr = placement.master_addr
    if not master_addr:
        master_addr = None
        if hosts:
            master_addr = hosts[0].host
    if nnodes is None or master_addr is None:
        raise DistEnvError(
            f"{placement.source} gives no node count or master address and there is no hostfile; "
            "pass --hostfile (or set MASTER_ADDR)"
        )
    slots = None
    if hosts:
        slots = hosts[0].slots
    port = master_port or placement.master_port
    if port is None:
        if hosts:
            port = derive_master_port(hosts, session)
        else:  # without a hostfile, the node count salts it too
            port = derive_master_port([Host(master_addr)], f"{session}/{nnodes}")
    # The flag, the launcher, the hostfile's slots=, this machine's GPUs: the first that says.
    processes = nproc_per_node or placement.nproc_per_node or slots or gpu_count() or 1
    return NodeEnv(
        node_rank=placement.node_rank,
        nnodes=nnodes,
        master_addr=master_addr,
        master_port=port,
        nproc_per_node=processes,
        source=placement.source,
        matched=placement.matched or placement.source,
    )


def _hostfile_decides(placement: Placement, hosts: Sequence[Host], match: Match) -> Placement:
    """The hostfile's node rank, node count and master, with the launcher's processes per node;
    refused when the launcher runs a different number of processes than the hostfile describes
    (the process group would wait forever for the missing ranks)."""
    per_node = placement.nproc_per_node or 1
    hostfile_processes = len(hosts) * per_node
    if placement.world_size is not None and placement.world_size != hostfile_processes:
        raise DistEnvError(
            f"{placement.source} runs {placement.world_size} processes, {per_node} on this node, "
            f"but the hostfile lists {len(hosts)} nodes ({hostfile_processes} processes at "
            f"{per_node} per node); run {per_node} per node on every hostfile node "
            "(mpirun -npernode N -H <all hostfile nodes>) or fix the hostfile"
        )
    per_node_variable = PER_NODE_VARIABLES.get(placement.source, placement.source)
    return replace(
        placement,
        node_rank=match.rank,
        nnodes=len(hosts),
        master_addr=None,  # the hostfile's first line
        matched=(
            f"{match.describe()} (hostfile node {match.rank}); "
            f"NPROC_PER_NODE from {per_node_variable}"
        ),
        verify_master=False,
    )


def master_problem(
    placement: Placement, master_addresses: Sequence[str], local_addresses: Sequence[str]
) -> str | None:
    """Why ``placement``'s master address cannot be right for this node, or ``None``: NODE_RANK 0
    must be the node MASTER_ADDR names (the node that hosts the rendezvous), so the master must be
    one of this node's addresses exactly when this is node 0. ``None`` too when the name does not
    resolve here (nothing to compare; the connection will say more)."""
    if placement.node_rank is None or placement.master_addr is None:
        return None
    if not master_addresses:
        return None
    local = set(local_addresses)
    is_here = any(address in local for address in master_addresses)
    loopback = all(address.startswith("127.") or address == "::1" for address in master_addresses)
    name = f"MASTER_ADDR={placement.master_addr}"
    if loopback and (placement.nnodes or 1) > 1:
        return (
            f"{name} is a loopback address but {placement.source} runs {placement.nnodes} nodes; "
            "set it to node 0's address"
        )
    if is_here and placement.node_rank != 0:
        return (
            f"{name} is this machine, but {placement.source} makes it node {placement.node_rank} "
            f"({placement.matched}); node 0 must be the master: set MASTER_ADDR to the node "
            "that runs rank 0"
        )
    if not is_here and placement.node_rank == 0:
        return (
            f"{name} is not this machine, but {placement.source} makes this node 0 "
            f"({placement.matched}); node 0 must be the master: set MASTER_ADDR to this node's "
            "address"
        )
    return None
