"""A training job as meshkit saves, finds and relaunches it. Pure: data and paths, no I/O.

A job is identified by where it lives and what it is called: its workdir and session name (two
projects may both use the default session without touching each other). It is saved in
``WORKDIR/.meshkit/SESSION/job.json``, and indexed beside the hostfile (``HOSTFILE_DIR/.meshkit/
jobs/HOSTFILE_NAME--SESSION.json``), so that ``status``, ``logs``, ``stop`` and a bare ``train``
find it from any node and any directory.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import PurePosixPath

from .digest import sha256_hex
from .errors import JobError, UsageError
from .events import NOTIFY_DEFAULT
from .health import HealthLimits
from .jobindex import index_file
from .record import asdict, build, field, record

JOB_FILE_MODE = 0o600  # job.json holds the config's `env`, where tokens go

TYPE_CHECKING = False  # no runtime `typing` on the env path (see meshkit/__init__.py)

if TYPE_CHECKING:
    from collections.abc import Sequence

    from .hostfile import Host
    from .protocol import EnvRequest, NodeJob

# tmux renames sessions containing '.' or ':' (my.job -> my_job), so neither is allowed.
_SESSION = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_-]{0,63}$")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
MAX_ENV_VALUE = 65536
SUPERVISOR_LOG = "supervisor-node{rank}.log"  # a node's supervisor's output, in the job home
REPLACE_AFTER = 300.0  # seconds a supervised relaunch waits for a node before it is lost
EVICT_AFTER = 2  # failures attributed to one node that make it a lemon (train --evict-after)
MAX_FAILED_STARTS = 3  # attempts in a row failing within --crash-window end supervision
CRASH_WINDOW = 300.0  # seconds: an attempt failing sooner "failed to start" (config crash_window)
NOTIFY_TIMEOUT = 30.0  # seconds the --notify command gets per event (config notify_timeout)
STEP_STALL_AFTER = 300.0  # seconds with no step of a rank that reports them: stalled
STRAGGLER_RATIO = 1.2  # a node this much slower than the median per step is a straggler
STRAGGLER_WINDOW = 60.0  # seconds the nodes' compute per step is compared over


def check_session(name: str) -> str:
    """Session names become tmux session names and path parts: keep them to tmux's own rules."""
    if not _SESSION.match(name):
        raise UsageError(
            f"session name {name[:70]!r}: use letters, digits, '_' or '-' (at most 64, no '.' or "
            "':', which tmux would rename)"
        )
    return name


def check_env(env: dict[str, str], where: str = "config meshkit.env") -> dict[str, str]:
    """Names become ``export NAME=...`` on every node: only shell variable names pass."""
    for name, value in env.items():
        if not ENV_NAME.match(name):
            raise UsageError(
                f"{where}: {name[:60]!r} is not a variable name (letters, digits, '_'; not first "
                "a digit)"
            )
        if len(value) > MAX_ENV_VALUE or "\0" in value:
            raise UsageError(f"{where}: the value of {name} is too long or holds a NUL byte")
    return env


def job_id(workdir: str, session: str) -> str:
    return sha256_hex(f"{workdir}\0{session}".encode())[:16]


@record
class Job:
    cmd: str
    workdir: str
    session: str
    hostfile: str
    python: str
    master_port: int
    nproc_per_node: int | None = None
    include: str | None = None
    exclude: str | None = None
    setup: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    restarts: int = 0  # train --restarts: relaunches a supervisor may make (0: unsupervised)
    restart_on: tuple[int, ...] = ()  # exit codes that restart; empty: any non-zero
    sync: bool = False  # the workdir is copied to every node (no shared storage)
    sync_exclude: tuple[str, ...] = ()  # names never copied (besides .git and __pycache__)
    spawn: bool = False  # train --spawn: `meshkit run --spawn` starts each node's ranks itself
    stall_after: float | None = 1800.0  # seconds with no output from any node: stalled (None: off)
    restart_on_stall: bool = False  # train --restart-on-stall: a supervisor restarts a stall
    replace_after: float | None = REPLACE_AFTER  # seconds before a node that does not answer
    # is lost and a spare takes its rank (None: never; wait for it, then give up)
    replaces_lost: bool = False  # train --replace-after D given (not off): supervised for lost
    # nodes even with --restarts 0 (a replacement uses up no restart)
    min_nodes: int | None = None  # with no healthy spare, relaunch on the nodes left if >= this
    generation: int = 1  # the membership's: one on with each replacement or shrink
    members: tuple[str, ...] = ()  # each rank's node since a change of membership (as the
    # hostfile spells it); empty: the hostfile's nodes (after --include/--exclude)
    launch: str = ""  # this train's id (``quorum.new_launch``): its discovery, supervision copies
    # and stops are its own, apart from any earlier launch of the same workdir and session
    evict: str = "unhealthy"  # train --evict: the health that puts a node out (or "degraded")
    evict_after: int = EVICT_AFTER  # failures attributed to one node that evict it (0: never)
    max_failed_starts: int = MAX_FAILED_STARTS  # failed starts in a row that end it (0: never)
    crash_window: float = CRASH_WINDOW  # an attempt failing sooner (s) failed to start
    notify: str | None = None  # train --notify: run under bash with each event as JSON on stdin
    notify_on: tuple[str, ...] = tuple(str(kind) for kind in NOTIFY_DEFAULT)  # the kinds told
    notify_timeout: float = NOTIFY_TIMEOUT
    health: HealthLimits = field(default_factory=HealthLimits)  # the thresholds health is read with
    step_stall_after: float | None = STEP_STALL_AFTER  # seconds with no step of a rank (of a job
    # that reports steps: meshkit.progress) that make a stall (None: off); --stall-after sets it
    straggler_ratio: float = STRAGGLER_RATIO  # train --straggler-ratio
    straggler_window: float = STRAGGLER_WINDOW  # config straggler_window
    evict_stragglers: bool = False  # train --evict-stragglers: a straggler is evicted

    @property
    def supervised(self) -> bool:
        """Whether a supervisor runs on every node: the job may be relaunched (``--restarts
        N``) or may have a lost node's rank given to a spare (``--replace-after`` given)."""
        return self.restarts > 0 or self.replaces_lost

    @property
    def id(self) -> str:
        return job_id(self.workdir, self.session)

    @property
    def label(self) -> str:
        """How messages name the job."""
        return f"{self.session!r} in {self.workdir}"

    @property
    def tmux_session(self) -> str:
        return f"{self.session}-{self.id[:8]}"

    @property
    def home(self) -> PurePosixPath:
        """Where the job keeps its file and logs: on shared storage, so every node sees them."""
        return job_home(self.workdir, self.session)

    @property
    def file(self) -> PurePosixPath:
        return self.home / "job.json"

    @property
    def index(self) -> str:
        return index_file(self.hostfile, self.session)

    def log(self, rank: int) -> str:
        return str(self.home / f"node{rank}.log")

    def meshkit_argv(self, task: str, *extra: str) -> list[str]:
        """``python -m meshkit TASK`` with the job's discovery flags: the same on every node."""
        argv = [self.python, "-m", "meshkit", task, "--hostfile", self.node_hostfile]
        argv += ["--session", self.session, "--master-port", str(self.master_port)]
        flags: dict[str, int | str | None] = {"--nproc-per-node": self.nproc_per_node}
        if not self.members:  # a membership's hostfile lists exactly its nodes
            flags["--include"] = self.include
            flags["--exclude"] = self.exclude
        for flag, value in flags.items():
            if value:
                argv += [flag, str(value)]
        return [*argv, *extra]

    @property
    def node_hostfile(self) -> str:
        """The hostfile the nodes read: a synced job carries its own copy beside the job file
        (the hostfile's own path may exist only on the launching machine); after a change of
        membership, that membership's own hostfile (its nodes in rank order, no spares)."""
        if self.members:
            return str(self.home / f"members-{self.generation}")
        if self.sync:
            return str(self.home / "hostfile")
        return self.hostfile

    @property
    def supervisor_tmux(self) -> str:
        return f"{self.tmux_session}-sup"

    def supervisor_log(self, rank: int) -> str:
        """Where the supervisor of node ``rank`` writes its output."""
        return str(self.home / SUPERVISOR_LOG.format(rank=rank))

    @property
    def supervisor_logs(self) -> str:
        """Every node's supervisor log, ``{rank}`` standing for the node's rank."""
        return str(self.home / SUPERVISOR_LOG)

    def home_copies(self, hosts: Sequence[Host]) -> list[Host]:
        """The nodes a file written into the job's home must reach: every node when the
        workdir is synced (each has its own copy), else the master (the others share its
        storage)."""
        return list(hosts) if self.sync else list(hosts[:1])

    def node_job(
        self, attempt: int = 1, reason: str = "start", replaced: str = "", last: int = 0
    ) -> NodeJob:
        """What every node is sent to start its part. Attempts after the first begin with a
        marker line in each log (logs append, so every attempt's output is kept). Every rank
        learns what happened: the restart count and ``reason``, the generation, and after a
        replacement which node replaced which (``replaced``). ``last``: the last attempt there
        may be (0: the first plus ``restarts``; a replacement uses up no restart)."""
        from .protocol import NodeJob

        cmd = self.cmd
        if attempt > 1:
            marker = f"===== meshkit: attempt {attempt} of {last or self.restarts + 1} ====="
            cmd = f"echo {shlex.quote(marker)}\n{cmd}"
        logs = str(self.home / "node{rank}.log")  # `meshkit run --log` fills in {rank}
        run = []
        if self.spawn:
            run.append("--spawn")
        run += ["--log", logs, "--cmd", cmd]
        return NodeJob(
            job_id=self.id,
            session=self.session,
            label=self.label,
            workdir=self.workdir,
            tmux_session=self.tmux_session,
            argv=self.meshkit_argv("run", *run),
            env=self.env | restart_env(attempt, reason, self.generation, replaced),
            setup=list(self.setup),
        )

    def env_request(self) -> EnvRequest:
        """Rank discovery on a node, with the flags the job's ``meshkit run`` gets there."""
        from .protocol import EnvRequest

        return EnvRequest(
            cwd=self.workdir,
            hostfile=self.node_hostfile,
            session=self.session,
            master_port=self.master_port,
            nproc_per_node=self.nproc_per_node,
            include=None if self.members else self.include,  # a membership lists its nodes
            exclude=None if self.members else self.exclude,
            launch=self.launch,
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    def index_json(self) -> str:
        index = {"workdir": self.workdir, "session": self.session, "id": self.id}
        return json.dumps(index) + "\n"


def restart_env(attempt: int, reason: str, generation: int, replaced: str) -> dict[str, str]:
    """What every rank learns of its attempt. TORCHELASTIC_RESTART_COUNT too, for scripts that
    read it: torchrun sets its own over this one (its restarts, not the supervisor's)."""
    env = {
        "MESHKIT_RESTART_COUNT": str(attempt - 1),
        "MESHKIT_RESTART_REASON": reason,
        "MESHKIT_GENERATION": str(generation),
        "TORCHELASTIC_RESTART_COUNT": str(attempt - 1),
    }
    if replaced:
        env["MESHKIT_REPLACED"] = replaced
    return env


def job_home(workdir: str, session: str) -> PurePosixPath:
    return PurePosixPath(workdir) / ".meshkit" / session


def job_file(workdir: str, session: str) -> PurePosixPath:
    return job_home(workdir, session) / "job.json"


def from_json(text: str, where: str) -> Job:
    try:
        job = build(Job, json.loads(text), where)
        check_session(job.session)
        check_env(job.env, where)
    except (ValueError, UsageError) as exc:
        raise JobError(
            f"{where}: not a meshkit job file ({exc}); relaunch with --cmd to replace it"
        ) from None
    return job


def workdir_from_index(text: str, where: str) -> str:
    try:
        data = json.loads(text)
        workdir = data["workdir"]
        if not isinstance(workdir, str) or not workdir.startswith("/"):
            raise TypeError("workdir is not an absolute path")
    except (ValueError, TypeError, KeyError) as exc:
        raise JobError(f"{where}: not a meshkit job index ({exc}); relaunch with --cmd") from None
    return workdir


def parse_restart_on(text: str | None) -> tuple[int, ...]:
    """``--restart-on 1,137``: exit codes 1..255; empty or None means any non-zero."""
    if text is None or not str(text).strip():
        return ()
    codes = []
    for written in str(text).split(","):
        part = written.strip()
        is_number = part.isascii() and part.isdigit()
        if not is_number or not 1 <= int(part) <= 255:
            raise UsageError(
                f"--restart-on {str(text)[:60]!r}: {part[:20]!r} is not an exit code 1..255 "
                "(give a comma list, e.g. 1,137)"
            )
        codes.append(int(part))
    return tuple(sorted(set(codes)))


_UNITS = {"s": 1, "m": 60, "h": 3600}


def parse_duration(text: str | float, where: str = "--stall-after") -> float | None:
    """``90s``, ``30m``, ``1h``, a number of seconds, or ``off`` (None)."""
    raw = str(text).strip().lower()
    if raw == "off":
        return None
    number = raw
    unit = "s"
    if raw[-1:] in _UNITS:
        number = raw[:-1]
        unit = raw[-1]
    try:
        seconds = float(number) * _UNITS[unit]
    except ValueError:
        seconds = -1.0
    if not 1 <= seconds <= 30 * 86400:
        raise UsageError(
            f"{where} {str(text)[:40]!r}: expected a duration (90s, 30m, 1h, seconds) of 1 s to "
            "30 days, or off"
        )
    return seconds
