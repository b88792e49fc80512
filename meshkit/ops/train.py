"""``train`` as one op: everything ``meshkit train`` decides, in order, returning data. Shared
workdir or sync, ending an old supervisor, the doctor's quick checks, the preflight and the
launch, then supervision. Each node round runs once: the env round feeds both the doctor and the
preflight; the facts round that tells whether the workdir is shared feeds the doctor too.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..envrun import check_spawn_cmd
from ..errors import LaunchError, MeshkitError, UsageError
from ..events import Event, EventKind
from ..hostfile import Host, members_text
from ..job import Job, parse_duration, parse_restart_on
from ..outcome import ProgressFn
from ..protocol import Supervision, SupervisorState
from ..quorum import new_launch
from ..record import replace
from ..settings import Config
from . import doctor
from .admission import Admitted, admit, evicted_before
from .events import new_event, tell
from .health import health_round
from .jobs import Launch, env_round, launch
from .jobs import stop as ops_stop
from .lookup import (
    Options,
    cluster_hosts,
    count_flag,
    evict_flag,
    min_nodes_flag,
    new_job,
    notify_on_flag,
    ratio_flag,
    restarts_flag,
    saved,
)
from .pool import NodePool, connect
from .supervision import end_supervisor, start_all, write
from .sync import Facts, sync_workdir, unshared


@dataclass(frozen=True)
class SupervisorPlaces:
    """Where ``train --restarts`` started the job's supervisors."""

    tmux_session: str  # on every node
    log: str  # with {rank}


@dataclass(frozen=True)
class TrainResult:
    """What ``train`` did. ``launch`` is None when the doctor's checks failed (``doctor`` says
    which): nothing was started then."""

    job: Job
    launch: Launch | None
    lacking: list[str]  # nodes that did not see the workdir (so it was synced)
    doctor: doctor.Report | None = None
    supervisor: SupervisorPlaces | None = None

    @property
    def ok(self) -> bool:
        return self.launch is not None and self.launch.ok


def plan(conf: Config, options: Options) -> tuple[Job, list[Host]]:
    """The job ``train`` starts: a new one from ``cmd`` and the flags over the configuration, or
    (``cmd`` None) the saved one, keeping its ``--restarts``/``--restart-on``/``--spawn`` unless
    told otherwise. Usage errors first, before anything is read from a node."""
    count = restarts_flag(options.restarts)
    codes = parse_restart_on(options.restart_on)
    stall = None if options.stall_after is None else parse_duration(options.stall_after)
    stall_flag = options.restart_on_stall
    min_nodes = min_nodes_flag(options.min_nodes)
    if options.cmd is None:
        job, hosts = saved(conf, options.hostfile, options.session, options.workdir)
        job = replace(job, launch=new_launch(job.launch))
    else:
        job, hosts = new_job(conf, options)
        previous = previous_job(conf, options, job)
        generation = 1 if previous is None else previous.generation + 1
        before = "" if previous is None else previous.launch
        job = replace(job, generation=generation, launch=new_launch(before))
    # a flag given overrides the saved job's setting (a new job starts from the defaults)
    job = replace(
        job,
        restarts=job.restarts if count is None else count,
        restart_on=job.restart_on if options.restart_on is None else codes,
        spawn=job.spawn or options.spawn,
        stall_after=job.stall_after if options.stall_after is None else stall,
        step_stall_after=job.step_stall_after if options.stall_after is None else stall,
        restart_on_stall=job.restart_on_stall if stall_flag is None else stall_flag,
        min_nodes=job.min_nodes if min_nodes is None else min_nodes,
    )
    evict = evict_flag(options.evict)
    evict_after = count_flag(options.evict_after, "--evict-after")
    failed_starts = count_flag(options.max_failed_starts, "--max-failed-starts")
    notify_on = notify_on_flag(options.notify_on)
    notify = job.notify if options.notify is None else options.notify
    if notify is not None and notify.strip() in ("", "off"):
        notify = None
    job = replace(
        job,
        evict=job.evict if evict is None else evict,
        evict_after=job.evict_after if evict_after is None else evict_after,
        max_failed_starts=job.max_failed_starts if failed_starts is None else failed_starts,
        notify=notify,
        notify_on=job.notify_on if notify_on is None else notify_on,
    )
    ratio = ratio_flag(options.straggler_ratio)
    evict_stragglers = options.evict_stragglers
    job = replace(
        job,
        straggler_ratio=job.straggler_ratio if ratio is None else ratio,
        evict_stragglers=job.evict_stragglers if evict_stragglers is None else evict_stragglers,
    )
    if options.replace_after is not None:
        after = parse_duration(options.replace_after, "--replace-after")
        job = replace(job, replace_after=after, replaces_lost=after is not None)
    if options.spawn:
        check_spawn_cmd(job.cmd)
    if job.restart_on_stall and (not job.restarts or job.stall_after is None):
        raise UsageError("--restart-on-stall needs --restarts N and a --stall-after (not off)")
    if job.min_nodes is not None and job.min_nodes > len(hosts):
        raise UsageError(
            f"--min-nodes {job.min_nodes}: the job has {len(hosts)} nodes; give at most that"
        )
    return job, hosts


def previous_job(conf: Config, options: Options, job: Job) -> Job | None:
    """The saved job a new one of the same workdir and session replaces (None: none, or one that
    no longer reads). The new one's generation is one past its, so that a supervisor the old job
    left on a node outside the new one's (a spare that had taken a rank, say) finds a newer
    generation without its node, and its launch id is later than its, so that every node keeps
    the new job's supervision copies over the old one's."""
    try:
        previous, _ = saved(conf, options.hostfile, options.session, options.workdir)
    except MeshkitError:  # none, or one that no longer reads: nothing of it to fence
        return None
    if previous.id != job.id:
        return None
    return previous


def train(
    conf: Config,
    job: Job,
    hosts: list[Host],
    options: Options,
    progress: ProgressFn | None = None,
) -> TrainResult:
    """Start (``options.cmd`` given) or relaunch the planned ``job`` on every node, over one
    connection and agent per node."""
    lacking: list[Host] = []
    facts: Facts | None = None
    spares: list[Host] = []
    if job.supervised:  # a spare may take an unhealthy node's rank from the start
        spares = [host for host in cluster_hosts(job) if host not in hosts]
    every = [*hosts, *spares]
    with connect(conf, job.hostfile, every, job.python, progress, options.wait) as pool:
        health = health_round(pool, job, every)
        evicted = evicted_before(pool, job, every) if job.supervised else []
        admitted = admit(job, hosts, spares, health, evicted, options.readmit)
        if admitted.hosts != hosts:
            hosts = admitted.hosts
            job = replace(job, members=tuple(host.label for host in hosts))
        if options.cmd is not None and not job.sync and not options.dry_run:
            lacking, facts = unshared(pool, job.workdir, hosts)
        if options.sync or lacking:
            job = replace(job, sync=True)
        if not options.dry_run:
            left = end_supervisor(pool, job, hosts)
            if left:
                raise LaunchError([*left, "train: the old supervisor did not end"])
        copied = None
        if job.sync and not options.dry_run:
            # before the env round: discovery runs in the workdir on every node
            copied = sync_workdir(pool, job, hosts, lacking if facts is not None else None)
        if admitted.swapped and not options.dry_run:
            for where in job.home_copies(hosts):  # the membership's own hostfile, as a change's
                pool.write_file(where, job.node_hostfile, members_text(hosts))
        envs = env_round(pool, job, hosts)
        report = None
        if options.doctor:
            # a copy made since the facts round changed what it saw: the doctor looks again
            reuse = facts if copied is None else None
            report = doctor.quick(pool, job, hosts, envs, reuse)
            if not report.ok:
                return TrainResult(job, None, [host.label for host in lacking], report)
        launched = launch(
            pool,
            job,
            hosts,
            replace=options.replace,
            dry_run=options.dry_run,
            envs=envs,
            synced=copied,
        )
        started = None
        if launched.ok and not launched.dry_run:
            said = [launched_event(launched.job, hosts), *admission(launched.job, admitted)]
            tell(pool, launched.job, [host for host in every if host not in pool.failures], said)
        if launched.ok and not launched.dry_run and launched.job.supervised:
            started = start_supervisor(pool, launched.job, hosts, admitted.evicted)
            clear_spares(pool, launched.job, [host for host in every if host not in hosts])
    lacking_labels = [host.label for host in lacking]
    return TrainResult(launched.job, launched, lacking_labels, report, started)


def clear_spares(pool: NodePool, job: Job, spares: list[Host]) -> None:
    """On the hostfile's nodes outside the job (``spares``: its spares, nodes an earlier launch
    lost or the launch kept out), end what an earlier launch left there: its supervisor, its
    record copy (a stale stop would end this job the moment the spare took a rank), its part of
    the job. Over train's own connections (a supervised train connects to them for their
    health). A spare that does not answer keeps them, harmlessly: this launch's id is later, so
    every node keeps this launch's copies over them, every reader ignores them, and a
    supervisor of the earlier launch that meets this one's copies ends."""
    if not spares:
        return
    end_supervisor(pool, job, spares)
    ops_stop(pool, job, spares)


def launched_event(job: Job, hosts: list[Host]) -> Event:
    """The history's first event of this launch (``meshkit events``)."""
    spares = len([host for host in cluster_hosts(job) if host not in hosts])
    where = f"{len(hosts)} nodes" + (f" and {spares} spares" if spares and job.supervised else "")
    return new_event(job, EventKind.LAUNCHED, f"train started {job.label} on {where}", by="train")


def admission(job: Job, admitted: Admitted) -> list[Event]:
    """The launch's events of whom it admitted: each node kept out for a spare, a readmission."""
    events = []
    for line in admitted.swapped:
        node, _, spare = line.partition(" -> ")
        why = next((text for text in admitted.evicted if text.startswith(f"{node}: ")), node)
        text = f"{why}; {spare} takes its rank from the start"
        events.append(new_event(job, EventKind.EVICTED, text, node=node, by="train"))
    if admitted.readmitted is not None:
        text = f"{admitted.readmitted} readmitted (train --readmit): it may take a rank again"
        events.append(
            new_event(job, EventKind.READMITTED, text, node=admitted.readmitted, by="train")
        )
    return events


def start_supervisor(
    pool: NodePool, job: Job, hosts: list[Host], evicted: list[str] | None = None
) -> SupervisorPlaces:
    """A supervisor in tmux on every node, after the first record is on every node (with the
    nodes kept out of the job, ``evicted``)."""
    record = Supervision(
        SupervisorState.RUNNING,
        1,
        job.restarts,
        generation=job.generation,
        members=list(job.members),
        launch=job.launch,
        evicted=list(evicted or []),
    )
    stop = "`meshkit stop` ends the job"
    if write(pool, job, hosts, record, 0, every=True) is None:
        what = "its supervision record could not be written on every node"
        raise LaunchError(f"the job started but {what}; {stop}")
    failed = start_all(pool, job, hosts)
    if failed:
        raise LaunchError([*failed, f"the job started but not every node's supervisor did; {stop}"])
    return SupervisorPlaces(job.supervisor_tmux, job.supervisor_logs)
