"""Which job a command is about: a new one from flags over the configuration, or the saved one,
found from any node and any directory (``--workdir``, else the index beside the hostfile, else the
current directory), and the nodes it runs on."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from ..errors import JobError, UsageError
from ..events import EventKind
from ..health import HealthLimits
from ..hostfile import Host, active
from ..job import (
    Job,
    check_env,
    check_session,
    from_json,
    job_file,
    parse_duration,
    workdir_from_index,
)
from ..jobindex import index_file
from ..outcome import ProgressFn
from ..record import replace
from ..settings import Config, pick, pick_int, whole
from .membership import resolve
from .pool import NodePool, connect

T = TypeVar("T")

WAIT_LIMIT_S = 86400  # --wait: a day is the longest a reboot may take
RESTARTS_LIMIT = 1000
LOG_LINES_LIMIT = 100000


@dataclass(frozen=True)
class Options:
    """The flags of a job to start (over the configuration): what ``meshkit train`` and
    ``Cluster.train`` are told, as one record they (and the doctor's, demo's new job) pass on."""

    cmd: str | None = None  # None: relaunch the saved job
    workdir: str | None = None
    session: str | None = None
    hostfile: str | None = None
    nproc_per_node: str | int | None = None
    master_port: str | int | None = None
    include: str | None = None
    exclude: str | None = None
    restarts: str | int | None = None
    restart_on: str | None = None
    spawn: bool = False
    stall_after: str | None = None
    restart_on_stall: bool | None = None  # None: the saved job's setting
    replace_after: str | float | None = None  # None: the saved job's (default 300 s); "off"
    min_nodes: str | int | None = None  # None: the saved job's (default: never shrink)
    sync: bool = False  # copy the workdir even where it is shared
    replace: bool = False  # end other meshkit jobs on the nodes
    doctor: bool = False  # the doctor's quick checks first (any failure starts nothing)
    dry_run: bool = False
    wait: float = 0.0  # seconds to wait for unreachable (rebooting) nodes
    evict: str | None = None  # "unhealthy" (default) or "degraded": the health that evicts
    evict_after: str | int | None = None  # failures attributed to a node before it is evicted
    max_failed_starts: str | int | None = None  # failed starts in a row that end supervision
    notify: str | None = None  # a command told each event (JSON on stdin); "" or "off": none
    notify_on: str | None = None  # comma list of event kinds (default: NOTIFY_DEFAULT)
    readmit: str | None = None  # a node evicted from the saved job, let back in
    straggler_ratio: str | float | None = None  # a node this much slower is a straggler
    evict_stragglers: bool | None = None  # None: the saved job's setting


def restarts_flag(flag: str | int | None) -> int | None:
    """``--restarts`` as a number (None: not given, the saved job's count stays)."""
    if flag is None:
        return None
    text = str(flag).strip()
    if not whole(text) or not 0 <= int(text) <= RESTARTS_LIMIT:
        raise UsageError(f"--restarts {str(flag)[:40]!r}: expected a whole number 0..1000")
    return int(text)


def min_nodes_flag(flag: str | int | None) -> int | None:
    """``--min-nodes`` as a number (None: not given)."""
    if flag is None:
        return None
    text = str(flag).strip()
    if not whole(text) or not 1 <= int(text) <= 4096:
        raise UsageError(
            f"--min-nodes {str(flag)[:40]!r}: expected a whole number of nodes, 1..4096"
        )
    return int(text)


def count_flag(flag: str | int | None, name: str, limit: int = 1000) -> int | None:
    """A whole-number flag 0..``limit`` (None: not given)."""
    if flag is None:
        return None
    text = str(flag).strip()
    if not whole(text) or not 0 <= int(text) <= limit:
        raise UsageError(f"{name} {str(flag)[:40]!r}: expected a whole number 0..{limit}")
    return int(text)


def evict_flag(flag: str | None) -> str | None:
    """``--evict``: the health that puts a node out of the job (None: not given)."""
    if flag is None:
        return None
    if flag not in ("unhealthy", "degraded"):
        raise UsageError(f"--evict {flag[:40]!r}: expected unhealthy or degraded")
    return flag


def notify_on_flag(flag: str | None) -> tuple[str, ...] | None:
    """``--notify-on``: a comma list of event kinds (None: not given)."""
    if flag is None:
        return None
    kinds = [kind.strip() for kind in flag.split(",") if kind.strip()]
    known = [str(kind) for kind in EventKind]
    unknown = [kind for kind in kinds if kind not in known]
    if unknown or not kinds:
        raise UsageError(f"--notify-on {flag[:80]!r}: expected a comma list of {', '.join(known)}")
    return tuple(kinds)


def ratio_flag(flag: str | float | None) -> float | None:
    """``--straggler-ratio`` as a number above 1 (None: not given)."""
    if flag is None:
        return None
    try:
        ratio = float(str(flag).strip())
    except ValueError:
        ratio = 0.0
    if not 1.0 < ratio <= 100.0:
        raise UsageError(f"--straggler-ratio {str(flag)[:40]!r}: expected a number above 1 (1.2)")
    return ratio


def check_options(options: Options) -> None:
    """The ranges of a job's flags, for ``meshkit train`` and ``Cluster.train`` alike (the
    messages name the CLI's flags): checked before anything is read from a node."""
    if not 0 <= options.wait <= WAIT_LIMIT_S:
        raise UsageError(f"--wait {options.wait}: expected seconds between 0 and 86400")
    restarts_flag(options.restarts)
    min_nodes_flag(options.min_nodes)
    evict_flag(options.evict)
    count_flag(options.evict_after, "--evict-after")
    count_flag(options.max_failed_starts, "--max-failed-starts")
    notify_on_flag(options.notify_on)
    ratio_flag(options.straggler_ratio)
    if options.replace_after is not None:
        parse_duration(options.replace_after, "--replace-after")


def check_log_flags(node: int | str | None, lines: int | str, rank_count: int) -> None:
    """The ranges of ``meshkit logs``'s and ``Cluster.logs``'s flags, for a job of
    ``rank_count`` nodes."""
    if node is not None and not 0 <= int(node) < rank_count:
        raise UsageError(f"--node {node}: the job has ranks 0..{rank_count - 1}")
    if not 0 <= int(lines) <= LOG_LINES_LIMIT:
        raise UsageError(f"--lines {lines}: expected 0..100000")


def read_local(path: str, limit: int = 1 << 20) -> str | None:
    """A file of this machine, at most ``limit`` bytes; None when it is not there."""
    try:
        with open(path, "rb") as handle:
            return handle.read(limit).decode(errors="replace")
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise JobError(f"{path}: cannot read: {exc.strerror or exc}") from None


def find_job(
    session: str,
    *,
    workdir: str | None,
    hostfile: str | None,
    cwd: str,
    read: Callable[[str], str | None] = read_local,
) -> Job:
    """The saved job: in ``--workdir`` if given; else through the index beside the hostfile;
    else in the current directory. The error says everywhere it looked."""
    check_session(session)
    looked: list[str] = []

    def load(directory: str) -> Job | None:
        path = str(job_file(directory, session))
        looked.append(path)
        text = read(path)
        return None if text is None else from_json(text, path)

    if workdir:
        job = load(str(Path(workdir).absolute()))
    else:
        job = None
        if hostfile:
            index = index_file(str(Path(hostfile).absolute()), session)
            looked.append(index)
            text = read(index)
            if text is not None:
                job = load(workdir_from_index(text, index))
        if job is None:
            job = load(cwd)
    if job is None:
        places = [f"  {path}" for path in dict.fromkeys(looked)]
        fix = "start one with: meshkit train --cmd CMD (or pass --hostfile/--workdir/--session)"
        raise JobError([f"no saved job {session!r}; looked in:", *places, fix])
    return job


def saved(
    conf: Config, hostfile: str | None, session: str | None, workdir: str | None
) -> tuple[Job, list[Host]]:
    """The saved job of these flags (over the configuration) and its nodes, from its hostfile (a
    synced job's copy when this machine lacks the path)."""
    job = find_job(
        check_session(str(pick(conf, "session", session))),
        workdir=pick(conf, "workdir", workdir),
        hostfile=os.path.abspath(str(pick(conf, "hostfile", hostfile))),
        cwd=os.getcwd(),
    )
    return job, job_hosts(job, cluster_hosts(job))


def cluster_hosts(job: Job) -> list[Host]:
    """Every node of the job's hostfile, spares included (a synced job's copy when this machine
    lacks the path), after its --include/--exclude."""
    from ..discovery import read_hosts

    path = job.hostfile
    if job.sync and not os.path.exists(path):
        copy = str(job.home / "hostfile")
        if os.path.exists(copy):
            path = copy
    return read_hosts(path, job.include, job.exclude, spares=True)


def job_hosts(job: Job, cluster: Sequence[Host]) -> list[Host]:
    """The job's nodes in rank order: its membership (after a replacement or a shrink), else
    the hostfile's nodes that are not spares."""
    if not job.members:
        return active(cluster)
    return resolve(job.members, cluster, job.hostfile)


def on_saved(
    conf: Config,
    hostfile: str | None,
    session: str | None,
    workdir: str | None,
    op: Callable[[NodePool, Job, list[Host]], T],
    progress: ProgressFn | None = None,
    spares: bool = False,
) -> tuple[Job, T]:
    """The saved job of these flags, and ``op`` run on its nodes over one connection per node
    (status, diagnose, stop: the CLI's and the Python API's). ``spares``: a supervised job's
    pool connects to the hostfile's nodes outside its membership too (status shows them)."""
    job, hosts = saved(conf, hostfile, session, workdir)
    nodes = list(hosts)
    if spares and job.supervised:
        nodes += [host for host in cluster_hosts(job) if host not in hosts]
    with connect(conf, job.hostfile, nodes, job.python, progress) as pool:
        return job, op(pool, job, hosts)


def new_job(conf: Config, options: Options) -> tuple[Job, list[Host]]:
    """A job from flags over the configuration, with the nodes it runs on (read once, also for
    the derived port)."""
    from ..discovery import read_hosts
    from ..topology import derive_master_port

    name = check_session(str(pick(conf, "session", options.session)))
    path = os.path.abspath(str(pick(conf, "hostfile", options.hostfile)))
    include = pick(conf, "include", options.include)
    exclude = pick(conf, "exclude", options.exclude)
    hosts = read_hosts(path, include, exclude)
    cmd = options.cmd or ""
    if not cmd.strip():
        raise UsageError("--cmd is empty: give the command every node should run")
    workdir = pick(conf, "workdir", options.workdir) or os.getcwd()
    master_port = pick_int(conf, "master_port", options.master_port)
    if not master_port:
        master_port = derive_master_port(hosts, name)
    nproc_per_node = pick_int(conf, "nproc_per_node", options.nproc_per_node, allow_auto=True)
    job = Job(
        cmd=cmd,
        workdir=os.path.abspath(workdir),
        session=name,
        hostfile=path,
        python=str(conf.python or sys.executable),
        master_port=master_port,
        nproc_per_node=nproc_per_node,
        include=include,
        exclude=exclude,
        setup=tuple(conf.setup),
        env=check_env(dict(conf.env)),
        sync_exclude=tuple(conf.sync_exclude),
        stall_after=parse_duration(conf.stall_after, "config stall_after"),
        step_stall_after=parse_duration(conf.step_stall_after, "config step_stall_after"),
        straggler_window=config_seconds(conf.straggler_window, "config straggler_window"),
        crash_window=config_seconds(conf.crash_window, "config crash_window"),
        notify_timeout=config_seconds(conf.notify_timeout, "config notify_timeout"),
        health=HealthLimits(
            min_free_mib=config_count(conf.health_min_free_mib, "config health_min_free_mib"),
            xid_window=config_seconds(conf.health_xid_window, "config health_xid_window"),
        ),
    )
    return job, hosts


def config_seconds(text: str, where: str) -> float:
    """A duration of the configuration that cannot be off ("5m", "30s")."""
    seconds = parse_duration(text, where)
    if seconds is None:
        raise UsageError(f"{where}: expected a duration such as 30s or 5m, not off")
    return seconds


def config_count(value: int, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 1 << 30:
        raise UsageError(f"{where}: expected a whole number 0..{1 << 30}")
    return value


def saved_or_new(
    conf: Config,
    hostfile: str | None,
    session: str | None,
    workdir: str | None,
    master_port: str | int | None = None,
    include: str | None = None,
    exclude: str | None = None,
) -> tuple[Job, list[Host], str]:
    """The saved job of ``session`` when there is one (its port, workdir, interpreter), else what
    ``train`` would start with these flags; and which of the two, in words (the doctor's)."""
    try:
        job, hosts = saved(conf, hostfile, session, workdir)
    except JobError:
        flags = Options(
            cmd="meshkit doctor",
            workdir=workdir,
            session=session,
            hostfile=hostfile,
            master_port=master_port,
            include=include,
            exclude=exclude,
        )
        job, hosts = new_job(conf, flags)
        return job, hosts, f"session {job.session!r} (no saved job; port derived)"
    port_flag = pick_int(conf, "master_port", master_port)
    if port_flag:
        job = replace(job, master_port=port_flag)
    return job, hosts, f"saved job {job.label}"
