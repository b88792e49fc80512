"""A real SLURM cluster on the sandbox nodes (Debian ``slurm-wlm`` and ``munge``): ``slurmctld``
and ``munged`` in node0, one ``slurmd`` per node, each inside its node's namespaces, so that a
node's death or ``sandbox.down`` ends them with the node's other processes.

Everything is private to the sandbox directory: ``slurm.conf``/``cgroup.conf`` there (clients
find them through ``SLURM_CONF``), munge with its own key and socket (``AuthInfo=socket=``), state
and logs there, spools in each node's own ``/tmp``. Nothing of the host's ``/etc/slurm``,
``/etc/munge`` or ``/run`` is read or written.

Two facts of running slurmd in a network namespace: ``ip netns exec`` mounts a fresh ``/sys``
without ``/sys/fs/cgroup``, and slurmd 22.05 refuses to start without its cgroup plugin. A private
tmpfs on ``/sys/fs/cgroup`` (in the node's own mount namespace) plus ``CgroupPlugin=cgroup/v1``,
with process tracking by ``/proc`` (``proctrack/linuxproc``) and no task/accounting plugins, starts
it without touching the host's cgroups.
"""

from __future__ import annotations

import os
import secrets
import shlex
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from ..errors import SandboxError
from .layout import Layout, Node
from .system import need, nsenter, write

# sinfo and sbatch come with srun (slurm-client)
PROGRAMS = {
    "slurmctld": "slurmctld",
    "slurmd": "slurmd",
    "srun": "slurm-client",
    "munged": "munge",
}
READY_TIMEOUT = 60.0  # slurmd registration on a loaded machine
# Declared, not detected (SlurmdParameters=config_overrides): the same on any host.
CPUS_PER_NODE = 4


def slurm_dir(sandbox: Layout) -> Path:
    return sandbox.root / "slurm"


def conf_path(sandbox: Layout) -> Path:
    """What ``SLURM_CONF`` must name for srun/sbatch/sinfo to use this sandbox's cluster."""
    return slurm_dir(sandbox) / "slurm.conf"


def munge_socket(sandbox: Layout) -> Path:
    return slurm_dir(sandbox) / "munge" / "munge.socket"


def preflight() -> None:
    need(PROGRAMS, "--slurm needs SLURM and munge")


def slurm_conf(sandbox: Layout) -> str:
    directory = slurm_dir(sandbox)
    master = sandbox.nodes[0]
    nodes = "".join(
        f"NodeName={node.name} NodeAddr={node.address} NodeHostname={node.name} "
        f"CPUs={CPUS_PER_NODE} State=UNKNOWN\n"
        for node in sandbox.nodes
    )
    return f"""\
# meshkit sandbox {sandbox.name}: a private SLURM cluster (SLURM_CONF={directory / "slurm.conf"})
ClusterName=meshkit{sandbox.name}
SlurmctldHost={master.name}({master.address})
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket(sandbox)}
SlurmUser=root
SlurmdUser=root
StateSaveLocation={directory / "state"}
SlurmdSpoolDir=/tmp/meshkit-slurmd
SlurmctldPidFile=/tmp/meshkit-slurmctld.pid
SlurmdPidFile=/tmp/meshkit-slurmd.pid
SlurmctldLogFile={directory / "logs" / "slurmctld.log"}
SlurmdLogFile={directory / "logs" / "slurmd.%n.log"}
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
SwitchType=switch/none
MpiDefault=none
LaunchParameters=use_interactive_step
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
MinJobAge=300
KillWait=5
Waittime=0
{nodes}PartitionName=sandbox Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
"""


CGROUP_CONF = """\
# meshkit sandbox: slurmd needs a cgroup plugin to start; nothing here uses cgroups
CgroupPlugin=cgroup/v1
CgroupAutomount=no
ConstrainCores=no
ConstrainRAMSpace=no
ConstrainDevices=no
"""


# The sandbox's slurm directory ("") and its subdirectories, with their modes.
SLURM_DIRECTORIES = {"": 0o755, "state": 0o700, "logs": 0o755, "munge": 0o700}


def prepare(sandbox: Layout) -> None:
    """slurm.conf, cgroup.conf, a fresh munge key and the state/log directories."""
    directory = slurm_dir(sandbox)
    shutil.rmtree(directory, ignore_errors=True)
    for sub, mode in SLURM_DIRECTORIES.items():
        (directory / sub).mkdir(parents=True, exist_ok=True)
        (directory / sub).chmod(mode)
    key = directory / "munge" / "munge.key"
    key.write_bytes(secrets.token_bytes(1024))
    key.chmod(0o400)
    write(directory / "slurm.conf", slurm_conf(sandbox))
    write(directory / "cgroup.conf", CGROUP_CONF)


def _spawn(sandbox: Layout, node: Node, script: str, log: str) -> None:
    """Run ``script`` (sh) detached inside ``node``'s namespaces; it dies with the node."""
    with open(slurm_dir(sandbox) / "logs" / log, "w") as out:
        subprocess.Popen(
            [*nsenter(node), "sh", "-c", script],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            start_new_session=True,
            env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "SLURM_CONF": str(conf_path(sandbox))},
        )


def _wait(what: str, ready: Callable[[], bool], sandbox: Layout) -> None:
    deadline = time.monotonic() + READY_TIMEOUT
    while not ready():
        if time.monotonic() > deadline:
            raise SandboxError(
                f"{what} not ready in {READY_TIMEOUT:.0f}s; see {slurm_dir(sandbox) / 'logs'}"
            )
        time.sleep(0.2)


def idle_nodes(sandbox: Layout) -> list[str]:
    """The nodes slurmctld reports ready for jobs."""
    env = {**os.environ, "SLURM_CONF": str(conf_path(sandbox))}
    argv = ["sinfo", "-h", "-N", "-o", "%N %T"]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=10, env=env)
    except subprocess.TimeoutExpired:
        return []
    idle = []
    for line in done.stdout.splitlines():
        row = line.split()
        if len(row) == 2 and row[1] in ("idle", "mixed", "allocated"):
            idle.append(row[0])
    return idle


def start_daemons(sandbox: Layout, node: Node) -> None:
    """This node's SLURM daemons (node0 also hosts munged and slurmctld); they die with the node."""
    if node == sandbox.nodes[0]:
        logs = slurm_dir(sandbox) / "logs"
        munge = slurm_dir(sandbox) / "munge"
        munge_socket(sandbox).unlink(missing_ok=True)
        munged = ["munged", "--foreground", "--force", f"--socket={munge_socket(sandbox)}"]
        munged += [f"--key-file={munge / 'munge.key'}", f"--pid-file={munge / 'munged.pid'}"]
        munged += [f"--log-file={logs / 'munged.log'}", f"--seed-file={munge / 'munged.seed'}"]
        _spawn(sandbox, node, f"exec {shlex.join(munged)}", "munged.out")
        _wait("munged", munge_socket(sandbox).exists, sandbox)
        _spawn(sandbox, node, "exec slurmctld -D -i", "slurmctld.out")
    # slurmd wants /sys/fs/cgroup: a private tmpfs, in this node's mount namespace only.
    script = (
        "mountpoint -q /sys/fs/cgroup || mount -t tmpfs -o size=64k meshkit-cgroup "
        f"/sys/fs/cgroup; exec slurmd -D -N {shlex.quote(node.name)}"
    )
    _spawn(sandbox, node, script, f"slurmd.{node.name}.out")


def wait_idle(sandbox: Layout, nodes: list[Node]) -> None:
    names = {node.name for node in nodes}

    def all_idle() -> bool:
        return names <= set(idle_nodes(sandbox))

    _wait(f"SLURM nodes {', '.join(sorted(names))}", all_idle, sandbox)


def start(sandbox: Layout) -> None:
    """munged and slurmctld in node0, slurmd in every node; returns when every node is idle.
    ``sandbox.down`` ends them with every other process of the nodes (``up`` ran the preflight)."""
    prepare(sandbox)
    for node in sandbox.nodes:
        start_daemons(sandbox, node)
    wait_idle(sandbox, sandbox.nodes)
