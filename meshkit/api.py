"""The Python API: what a notebook or a script calls, over the same ops the CLI renders.

    from meshkit import Cluster

    cluster = Cluster("hostfile")
    cluster.mesh()
    cluster.train("torchrun train.py", nproc_per_node=2)
    for row in cluster.status().rows:
        print(row.node_rank, row.host, row.state)
    cluster.stop()

Every method prints nothing, returns the typed records the CLI shows, and raises
``meshkit.errors.MeshkitError`` (with the same message the CLI prints) on bad input or a failure
it cannot report per node. Each call opens one connection and one agent per node and closes them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from . import settings
from .events import Event
from .hostfile import Host
from .job import Job
from .ops import diagnose as diagnose_op
from .ops import doctor as doctor_op
from .ops import events as events_op
from .ops import execute as execute_op
from .ops import jobs, lookup
from .ops import mesh as mesh_op
from .ops import top as top_op
from .ops import train as train_op
from .ops.pool import NodePool, connect, ssh_settings

T = TypeVar("T")


class Cluster:
    """The nodes of one hostfile, and the jobs (sessions) run on them."""

    def __init__(
        self,
        hostfile: str = "hostfile",
        *,
        session: str | None = None,
        workdir: str | None = None,
        conf: settings.Config | None = None,
    ) -> None:
        self.hostfile = hostfile
        self.session = session
        self.workdir = workdir
        self.conf = conf if conf is not None else settings.load()

    def mesh(
        self,
        *,
        identity: str | None = None,
        accept_new_host_keys: bool = False,
        skip_unreachable: bool = False,
        dry_run: bool = False,
        verify: bool = True,
    ) -> mesh_op.MeshReport:
        """``meshkit mesh``: every node can SSH to every node by every name, strictly verified."""
        from .discovery import read_hosts
        from .meshplan import mesh_id

        # the mesh's identity is the whole hostfile's: --include does not change it
        identity_of_mesh = mesh_id(read_hosts(self.hostfile, None, None, spares=True))
        hosts = read_hosts(self.hostfile, self.conf.include, self.conf.exclude, spares=True)
        ssh = ssh_settings(self.conf, self.hostfile, identity, accept_new=accept_new_host_keys)
        return mesh_op.mesh(
            hosts,
            ssh,
            identity_of_mesh,
            skip_unreachable=skip_unreachable,
            dry_run=dry_run,
            check=verify,
        )

    def train(
        self,
        cmd: str | None = None,
        *,
        nproc_per_node: int | str | None = None,
        master_port: int | None = None,
        spawn: bool = False,
        stall_after: str | None = None,
        restart_on_stall: bool | None = None,
        restarts: int | None = None,
        restart_on: str | None = None,
        replace_after: str | float | None = None,
        min_nodes: int | None = None,
        sync: bool = False,
        replace: bool = False,
        doctor: bool = False,
        dry_run: bool = False,
        wait: float = 0.0,
        evict: str | None = None,
        evict_after: int | None = None,
        max_failed_starts: int | None = None,
        notify: str | None = None,
        notify_on: str | None = None,
        readmit: str | None = None,
        straggler_ratio: float | None = None,
        evict_stragglers: bool | None = None,
    ) -> train_op.TrainResult:
        """``meshkit train``: start ``cmd`` on every node (None: relaunch the saved job)."""
        options = lookup.Options(
            cmd=cmd,
            workdir=self.workdir,
            session=self.session,
            hostfile=self.hostfile,
            nproc_per_node=nproc_per_node,
            master_port=master_port,
            restarts=restarts,
            restart_on=restart_on,
            replace_after=replace_after,
            min_nodes=min_nodes,
            spawn=spawn,
            stall_after=stall_after,
            restart_on_stall=restart_on_stall,
            sync=sync,
            replace=replace,
            doctor=doctor,
            dry_run=dry_run,
            wait=wait,
            evict=evict,
            evict_after=evict_after,
            max_failed_starts=max_failed_starts,
            notify=notify,
            notify_on=notify_on,
            readmit=readmit,
            straggler_ratio=straggler_ratio,
            evict_stragglers=evict_stragglers,
        )
        lookup.check_options(options)
        job, hosts = train_op.plan(self.conf, options)
        return train_op.train(self.conf, job, hosts, options)

    def job(self) -> Job:
        """The saved job of this session (found from any node and any directory)."""
        job, _ = lookup.saved(self.conf, self.hostfile, self.session, self.workdir)
        return job

    def status(self) -> jobs.JobStatus:
        """``meshkit status``: ``.rows``, one per node (a node that cannot be asked has
        ``error``), and a supervised job's ``.supervision``, once for the job (its record's
        fields, its leader, its spares' health; None: not supervised). Each row's
        ``.progress``: its ranks' steps (``meshkit.progress``); ``.stragglers()``: the nodes
        named slow. ``.as_json()``: the ``status --json`` objects."""
        return self._on_saved(jobs.job_status, spares=True)

    def events(self, since: float | None = None) -> list[Event]:
        """``meshkit events --json``: the job's history, read from every node of its hostfile
        (spares included) and merged, oldest first; ``since``: only the events at or after
        this wall-clock time (``time.time()`` seconds). ``Event.as_json()``: the ``--json``
        object. Nodes that could not be read are left out (their events are on the others)."""
        _, history = events_op.read(self.conf, self.hostfile, self.session, self.workdir, since)
        return history.events

    def diagnose(self) -> diagnose_op.Diagnosis:
        """``meshkit diagnose``: every rank's live stack, grouped; the outliers; the first
        failure."""
        return self._on_saved(diagnose_op.diagnose)

    def logs(self, lines: int = 20, node: int | None = None) -> list[jobs.LogChunk]:
        """``meshkit logs``: the last ``lines`` lines of each node's log (or one node's)."""
        job, hosts = lookup.saved(self.conf, self.hostfile, self.session, self.workdir)
        lookup.check_log_flags(node, lines, len(hosts))
        ranks = [node] if node is not None else list(range(len(hosts)))
        chosen = [hosts[rank] for rank in ranks]
        with connect(self.conf, job.hostfile, chosen, job.python) as pool:
            return jobs.logs(pool, job, hosts, ranks, lines)

    def stop(self) -> jobs.Stopped:
        """``meshkit stop``: the supervisor, then the job's whole tree on every node; verified."""
        return self._on_saved(jobs.stop_with_supervisors, spares=True)

    def exec(
        self, cmd: str, *, nodes: str | None = None, timeout: float | None = None
    ) -> list[execute_op.NodeResult]:
        """``meshkit exec``: ``cmd`` on every node (or the ranks ``nodes`` names: ``0-3,5``) at
        once, each with its node's ``meshkit env`` variables; a result per node, in rank order
        (exit code, output, why it failed). ``timeout``: seconds per node (default: config
        command_timeout)."""
        return execute_op.execute(
            self.conf,
            cmd,
            hostfile=self.hostfile,
            session=self.session,
            include=self.conf.include,
            exclude=self.conf.exclude,
            nodes=nodes,
            timeout=timeout,
        )

    def _on_saved(self, op: Callable[[NodePool, Job, list[Host]], T], spares: bool = False) -> T:
        _, result = lookup.on_saved(
            self.conf, self.hostfile, self.session, self.workdir, op, spares=spares
        )
        return result

    def doctor(
        self,
        *,
        quick: bool = False,
        timeout: float = 30.0,
        bandwidth: bool = False,
        min_ratio: float = 0.5,
        min_rate: float = 0.0,
    ) -> doctor_op.Report:
        """``meshkit doctor``: can this cluster train? Every check, each with its fix.
        ``bandwidth``: ``doctor --bandwidth`` instead (every pair's throughput both ways)."""
        job, hosts, _ = lookup.saved_or_new(self.conf, self.hostfile, self.session, self.workdir)
        return doctor_op.doctor(
            self.conf, job, hosts, quick, timeout, bandwidth, min_ratio, min_rate
        )

    def top(self) -> top_op.Snapshot:
        """``meshkit top --once``: one snapshot of every node (CPU, memory, load, network, GPUs,
        the job's ranks when the hostfile has a saved job), the odd ones out marked; a node that
        cannot be asked is in it, down, with ``error``."""
        watched = top_op.target(self.conf, self.hostfile, self.session, self.workdir)
        with connect(self.conf, watched.hostfile, watched.hosts, watched.python) as pool:
            return top_op.snapshot(pool, watched.hosts, watched.job)
