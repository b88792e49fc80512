"""What the controller and a node agent say to each other: typed requests and replies, one JSON
object per line over the stdin/stdout of a single exec channel.

Standard library only: the node side imports this too. Both sides bound what they read (a line is
at most ``MAX_LINE`` bytes) and check every field's type, so a reply from a node is data, never
trusted structure. ``OPS`` is the one table of operations: op -> request, reply and the handler
(a function of ``meshkit.node``); adding an op is a request class, a reply class and a row there.
"""

from __future__ import annotations

import json

from .events import Event
from .health import HealthLimits, NodeHealth
from .record import (
    Bytes,
    Count,
    ExitCode,
    FileMode,
    Index,
    Invalid,
    Pid,
    Port,
    StrEnum,
    WallTime,
    asdict,
    build,
    field,
    record,
)

TYPE_CHECKING = False  # no runtime `typing`: every agent imports this module (see record.py)
if TYPE_CHECKING:
    from typing import Any, Literal

VERSION = 4  # 4: the supervision record's membership and generation (spare nodes)
MAX_LINE = 1 << 20  # bytes in one request or reply line
MAX_LOG_BYTES = 256 * 1024  # log bytes one `logs` reply carries
PUT_CHUNK = 512 * 1024  # raw bytes one `put` carries (base64: well under MAX_LINE)
# bytes `exec` keeps of each stream's start and of its end: JSON writes a byte as at most 6
# (\u0000), so both streams' head and tail stay under MAX_LINE
EXEC_KEEP = 32 * 1024


ProtocolViolation = Invalid  # a line that is not a well-formed request or reply


class JobState(StrEnum):
    """A job on one node: its command runs, has exited (its code is kept), or is not there
    (never started, stopped, or gone with a reboot)."""

    RUNNING = "running"
    EXITED = "exited"
    ABSENT = "absent"


class SupervisorState(StrEnum):
    """A supervised job's supervision (the state machine: ``ops.supervision_policy``): RUNNING
    -> RELAUNCHING (the next attempt claimed) -> RUNNING ..., ending in GAVE_UP or DONE, or
    STOPPED by ``meshkit stop`` from any state."""

    RUNNING = "running"
    RELAUNCHING = "relaunching"
    GAVE_UP = "gave up"
    DONE = "done"
    STOPPED = "stopped"


class RestartReason(StrEnum):
    """Why an attempt was launched, as every rank reads it (``MESHKIT_RESTART_REASON``)."""

    START = "start"  # the first attempt, `meshkit train`
    FAILURE = "failure"  # a node exited non-zero or stopped answering
    STALL = "stall"  # --restart-on-stall
    REBOOT = "reboot"  # the job was gone from a node (rebooted, or ended outside meshkit)
    REPLACED = "replaced"  # a lost node's rank given to a spare
    SHRUNK = "shrunk"  # the lost nodes dropped (--min-nodes), ranks renumbered
    EVICTED = "evicted"  # an unhealthy node (or a lemon) put out, a spare took its rank


class SupervisorShown(StrEnum):
    """What status shows instead of a RUNNING or RELAUNCHING record's state when no node has a
    live supervisor to back it; never written in a record."""

    NOT_RESPONDING = "not responding"


@record
class Request:
    """Any op's request (the first column of ``OPS``)."""


@record
class Reply:
    """Any op's reply (the second column of ``OPS``)."""


@record
class EnvRequest(Request):
    """Rank discovery on the node for a job in ``cwd`` (its workdir), as ``meshkit run`` will do
    it there (``cwd``'s meshkit.yaml included); the fields are ``meshkit env``'s flags."""

    cwd: str
    hostfile: str
    session: str
    master_port: Port
    nproc_per_node: Count | None = None
    include: str | None = None
    exclude: str | None = None
    launch: str | None = None  # the train's launch: only its own membership is followed


@record
class EnvReply(Reply):
    """The variables the node would export, and where they came from; or why discovery failed
    there (``error``, the message ``meshkit env`` prints; the other fields are then empty)."""

    variables: dict[str, str]
    source: str
    matched: str | None
    interface_source: str
    error: str | None = None


@record
class PortsRequest(Request):
    """Which of ``ports`` a TCP listener could bind here; ``job_id``'s own job may hold one."""

    job_id: str
    ports: list[Port]


@record
class PortState:
    port: Port
    free: bool


@record
class PortsReply(Reply):
    ports: list[PortState]
    ours: bool  # the job asked about is running here (so its port is about to be freed)


@record
class NodeJob:
    """The one record of a job on a node: what the controller sends (``StartRequest``), what the
    agent saves in the job's state directory (``spec.json``) and what the keeper runs. The same on
    every node: each node discovers its own rank. ``argv`` is ``meshkit run ...``; ``env`` and
    ``setup`` come from config."""

    job_id: str
    session: str
    label: str  # how messages name the job: "SESSION in WORKDIR"
    workdir: str
    tmux_session: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    setup: list[str] = field(default_factory=list)

    def script(self) -> str:
        """What the keeper gives ``bash -c``: the setup lines, then the quoted ``argv``."""
        import shlex  # the agent's start does not need it; json has imported re already

        return "\n".join([*self.setup, shlex.join(self.argv)]) + "\n"


@record
class RunningJob:
    job_id: str
    label: str


@record
class StartRequest(Request):
    job: NodeJob
    replace: bool = False  # end other meshkit jobs running here (never without the user's say)
    launch: str = ""  # a supervised job's: its launch and generation, which this node refuses
    generation: Count = 0  # to start once its record copy holds their stop or a newer one


@record
class StartReply(Reply):
    started: bool
    state: JobState
    replaced: list[RunningJob]
    conflicts: list[RunningJob]
    error: str | None = None


@record
class JobsRequest(Request):
    """The meshkit jobs running on this node."""


@record
class JobsReply(Reply):
    running: list[RunningJob]


@record
class HealthRequest(Request):
    """This node's health (``meshkit.health``), read for a job's ``workdir`` (its file
    system's free space) and ``job_id`` (its processes' out-of-memory kills, its counters'
    baseline): ``gpus`` the node must have (the hostfile's slots, or as many as the job started
    with; None: no expectation), under ``limits``. Asked alone (op ``health``: train's
    preflight) or inside ``status``, ``doctor_facts`` and ``top``."""

    workdir: str
    job_id: str = ""
    gpus: Count | None = None
    limits: HealthLimits = field(default_factory=HealthLimits)


@record
class HealthReply(Reply):
    health: NodeHealth


@record
class RankProgress:
    """One rank's steps on this node, as it told them (``meshkit.progress``) in this attempt;
    rates over the request's window (None: too few checkpoints in it yet). Times are the
    node's own clock."""

    rank: Index
    step: Count  # steps done in this attempt
    age: float  # seconds since its last step was written (at most about a second late)
    rate: float | None = None  # steps per second over the window
    step_s: float | None = None  # seconds per step over the window
    compute_s: float | None = None  # compute seconds per step over the window (None: no sections)
    early_step_s: float | None = None  # seconds per step over its first minutes (None: not yet)


PROGRESS_WINDOW = 60.0  # seconds the rates are taken over unless asked otherwise


@record
class Straggler:
    """A node slower than the others per step of computation, and by how much
    (``meshkit.stragglers`` finds them; the supervision record keeps the leader's)."""

    node: str
    ratio: float  # its compute seconds per step over the nodes' median
    seconds: float  # its compute seconds per step
    median: float  # the nodes' median

    def why(self) -> str:
        """How much slower, in words."""
        mine = f"{self.seconds * 1000:.0f} ms"
        theirs = f"{self.median * 1000:.0f} ms"
        return f"{self.ratio:.2f}x the nodes' median compute per step ({mine}, {theirs})"

    def words(self) -> str:
        """How status, top and the events name it."""
        return f"{self.node}: {self.why()}"


@record
class StatusRequest(Request):
    job_id: str
    log: str
    health: HealthRequest | None = None  # read the node's health too (the supervisor's polls)
    window: float = PROGRESS_WINDOW  # seconds the ranks' step rates are taken over


@record
class StatusReply(Reply):
    state: JobState
    exit_code: ExitCode | None
    started: WallTime | None
    last_line: str | None
    idle: float | None = None  # seconds since the log was last written (the node's own clock)
    health: NodeHealth | None = None  # when asked
    ended: WallTime | None = None  # when the job's exit record was written (exited only)
    progress: list[RankProgress] = field(default_factory=list)  # ranks that told their steps


@record
class StopRequest(Request):
    job_id: str
    keep_exit: bool = False  # leave the exit record (a supervisor giving up keeps exit codes)


@record
class StopReply(Reply):
    found: bool  # the job had a keeper (or processes) here
    signalled: Count
    left: list[Pid]  # processes of the job still alive after TERM and KILL (looked, not assumed)


@record
class LogsRequest(Request):
    """The last ``lines`` lines of ``path``, or (``offset`` given) what was appended since."""

    path: str
    lines: Count = 20
    offset: Bytes | None = None


@record
class LogsReply(Reply):
    lines: list[str]
    offset: Bytes  # where the next `follow` read starts
    missing: bool = False


@record
class FactsRequest(Request):
    """Versions, GPUs, clock and the workdir: the master writes ``marker`` (holding ``token``)
    first, the other nodes then look for it (the workdir is shared if they all see it)."""

    workdir: str
    marker: str
    token: str
    write_marker: bool
    health: HealthRequest | None = None


@record
class FactsReply(Reply):
    hostname: str
    python: str
    meshkit: str
    torch: str | None
    cuda: str | None
    nccl: str | None
    gpus: Count
    clock: WallTime  # time.time() on the node when it answered
    writable: str | None  # None: the workdir is writable; else why not
    marker: str  # "written" | "seen" | why not (the marker is how "is the workdir shared" is told)
    health: NodeHealth | None = None  # when asked


@record
class ListenRequest(Request):
    """A short-lived TCP listener: on ``ifname``'s IPv4 address (None: every address) and
    ``port`` (0: any free one); it closes by itself after ``seconds``. ``bandwidth``: it serves
    throughput tests (``doctor_bandwidth``) instead of only accepting, on ``addresses`` (the
    tested ones; never every address), to peers that present ``token`` first."""

    ifname: str | None
    port: Port
    seconds: float
    bandwidth: bool = False
    addresses: list[str] = field(default_factory=list)
    token: str = ""


@record
class ListenReply(Reply):
    address: str
    port: Port
    error: str | None  # why it could not listen (a busy port names its holder when known)


@record
class ProbeTarget:
    label: str  # the peer as the hostfile spells it
    host: str
    port: Port


@record
class ConnectRequest(Request):
    """TCP connect to every target at once, retried until ``seconds`` have passed."""

    targets: list[ProbeTarget]
    seconds: float


@record
class ConnectResult:
    label: str
    port: Port
    ok: bool
    detail: str


@record
class ConnectReply(Reply):
    results: list[ConnectResult]


@record
class DoneRequest(Request):
    """Close this agent's doctor listeners; remove ``marker`` when given."""

    marker: str | None = None


@record
class DoneReply(Reply):
    closed: Count


@record
class ProbeRequest(Request):
    """Run ``argv`` (``meshkit run --cmd <collective probe>``) in ``cwd``, bounded by
    ``seconds``."""

    cwd: str
    argv: list[str]
    seconds: float


@record
class ProbeReply(Reply):
    code: ExitCode
    out: str
    err: str


@record
class BandwidthTarget(ProbeTarget):
    network: str  # this node's interface towards it


@record
class BandwidthRequest(Request):
    """Throughput to each target in turn, both ways, the best of ``repeats`` tries of at most
    ``seconds`` and ``max_bytes`` each way; also this node's networks and InfiniBand devices."""

    targets: list[BandwidthTarget]
    seconds: float
    max_bytes: Bytes
    repeats: Count
    token: str = ""  # the round's, which the targets' listeners ask for


@record
class BandwidthResult:
    label: str
    network: str
    sent: float  # bytes/s from this node to the peer (0 when it failed)
    received: float  # bytes/s from the peer to this node
    error: str | None


@record
class BandwidthReply(Reply):
    results: list[BandwidthResult]
    networks: list[str]  # "ifname address/prefixlen", IPv4, neither loopback nor link-local
    infiniband: list[str]  # "device:port state" from /sys/class/infiniband
    torch: bool  # torch is installed for this interpreter (the all_reduce needs it)


@record
class DiagnoseRequest(Request):
    """The job's ranks on this node (Python processes in its keeper's tree carrying ``RANK``):
    each one's stack (py-spy, at most ``seconds`` per rank), and the error files its ranks left in
    ``home`` (the job's directory); ``log`` is read for a traceback when there are none."""

    job_id: str
    home: str
    log: str
    seconds: float = 5.0
    stacks: bool = True  # False: the error files and the log only (a failure's cause record)


@record
class RankStack:
    rank: Index
    pid: Pid
    frames: list[str]  # the main thread, innermost last: "function (file:line)"
    threads: list[list[str]]  # the other threads' innermost frames
    error: str | None = None  # why the stack could not be read (and what to change)
    seq: Count | None = None  # flight recorder: the last collective it entered (0: none yet)
    collective: str | None = None  # ... and what it was: "gloo:all_reduce (scheduled)"


@record
class RankError:
    """What a rank left when it raised (``errors/rank<R>.json``, in torchelastic's error-file
    shape)."""

    rank: Index
    node_rank: Index | None  # the node the rank ran on (shared storage: every node sees every file)
    time: WallTime
    error: str  # the exception's last line
    traceback: list[str]


@record
class DiagnoseReply(Reply):
    state: JobState
    exit_code: ExitCode | None
    idle: float | None
    ranks: list[RankStack]
    errors: list[RankError]
    log_traceback: list[str]  # the log's last traceback, when no rank left an error file
    problem: str | None = None  # why no stack could be read at all (py-spy missing, say)
    # time.time() on the node when the request arrived: the controller knows when it sent it,
    # and corrects the node's error-file times by the difference (the nodes' clocks differ)
    clock: WallTime | None = None
    progress: list[RankProgress] = field(default_factory=list)  # ranks that told their steps


@record
class Supervision:
    """A supervised job's supervision record, as status shows it; every node of the job's
    hostfile keeps a copy. Every write bumps ``version``; which write a node keeps and which
    copy readers believe are ``quorum.keeps`` and ``quorum.believe`` (compare-and-set within a
    generation, a majority for a new one; a STOPPED record of the launch always lands, and
    nothing but another stop replaces it)."""

    supervisor: SupervisorState
    attempt: Count
    restarts_left: int
    last_restart_reason: str | None = None
    exit_codes: list[ExitCode | None] = field(default_factory=list)  # the last attempt's, per rank
    version: Count = 0
    by: Index = 0  # the rank whose supervisor wrote it (of a RELAUNCHING record: the claimer)
    held: str | None = None  # what holds the relaunch: "NODE: CHECK: DETAIL"
    diagnosis: str | None = None  # `diagnose --json` saved before the last stall restart
    reason: RestartReason = RestartReason.START  # why the current attempt was launched
    generation: Count = 1  # one on with each change of membership: a lost node is fenced by it
    members: list[str] = field(default_factory=list)  # each rank's node (as the hostfile
    # spells it) since the last change of membership; empty: the job's nodes as launched
    lost: list[str] = field(default_factory=list)  # nodes dropped from the membership for good
    replaced: list[str] = field(default_factory=list)  # "LOST -> SPARE", one per replacement
    waiting: str | None = None  # the lost node a relaunch waits for, and until when (UTC)
    launch: str = ""  # the train that started the job (``quorum.new_launch``): copies and
    # stops of another launch are not this job's
    evicted: list[str] = field(default_factory=list)  # "NODE: why", kept out of this job (never
    # its spare) until `train --readmit NODE`
    blamed: list[str] = field(default_factory=list)  # the node of each attributed failure (lemons)
    quick: list[str] = field(default_factory=list)  # the causes of the failed starts in a row
    # (attempts that failed within --crash-window): --max-failed-starts of them end supervision
    unhealthy: list[str] = field(default_factory=list)  # "NODE: why": members that are unhealthy
    # and that no spare could replace (the job runs on them; status and the events say so)
    stragglers: list[Straggler] = field(default_factory=list)  # named by the leader

    def to_json(self) -> str:
        """The copy as a node stores it."""
        return json.dumps(asdict(self), sort_keys=True) + "\n"


@record
class SupervisorRequest(Request):
    """The job's supervisor on this node, and this node's copy of the supervision record.
    ``action``: look; ``start`` one (``argv``, in tmux ``tmux_session``) unless one is live here;
    ``end`` it (and drop the copy, or keep a stop's ``record``). ``record``: write it as the copy
    unless the copy is newer than ``version`` (compare-and-set: two writers that read the same
    version cannot both win). ``session``, ``workdir``: the job's, which the supervisor's command
    line must name (its pid file may hold a pid reused by another job's supervisor)."""

    job_id: str
    tmux_session: str
    action: Literal["look", "start", "end"] = "look"
    argv: list[str] = field(default_factory=list)
    record: Supervision | None = None
    version: Count = 0
    session: str = ""
    workdir: str = ""


@record
class SupervisorReply(Reply):
    pid: Pid | None  # the live supervisor here (found before an ``end``)
    beat: float | None  # seconds since it last beat, on this node's clock (None: none here)
    left: list[Pid]  # an ended supervisor's processes that survived TERM and KILL
    record: Supervision | None  # this node's copy after the write (None: none or unreadable)
    written: bool = False


@record
class ManifestRequest(Request):
    """Size and mtime of every file under ``root`` (relative paths), ``exclude`` names skipped,
    in pages: ``page`` 0 starts the listing, each next one goes on while the reply says
    ``more``."""

    root: str
    exclude: list[str] = field(default_factory=list)
    page: Count = 0


@record
class FileState:
    path: str
    size: Bytes
    mtime: float
    mode: FileMode


@record
class Blocker:
    """An entry under a node's workdir that is neither a file nor a directory: sync writes
    nothing through it or over it."""

    path: str
    what: str  # "a symlink to /nvme/dataset", "a FIFO", ...


@record
class ManifestReply(Reply):
    exists: bool
    files: list[FileState]
    blockers: list[Blocker] = field(default_factory=list)
    more: bool = False  # another page follows


@record
class PutRequest(Request):
    """A chunk of a file (base64 ``data`` at ``offset``, at most ``PUT_CHUNK`` bytes); ``last``
    moves it into place with ``mode`` and ``mtime`` (until then it is a hidden temporary beside
    it). ``path`` is below ``root`` (the workdir; empty: ``path``'s own directory), through no
    link on the node."""

    path: str
    data: str
    offset: Bytes
    last: bool
    mode: FileMode = 0o644
    mtime: float = 0.0
    root: str = ""


@record
class WholeFile:
    """A small file in one piece: ``path`` (below the request's ``root``), base64 ``data``."""

    path: str
    data: str
    mode: FileMode
    mtime: float


@record
class PutFilesRequest(Request):
    """Small files at once (their data and paths together within ``PUT_CHUNK`` bytes), each
    written as a ``PutRequest`` of one last chunk writes it: one round trip for many."""

    root: str
    files: list[WholeFile]


@record
class PutReply(Reply):
    written: Bytes  # bytes


@record
class ExecRequest(Request):
    """Run ``cmd`` under bash in the user's home directory with the node's ``meshkit env``
    variables (``meshkit run --node-rank R``: the rest is the controller's hostfile, so a node
    needs no copy of it), in a session of its own, bounded by ``timeout`` seconds. Keeps the
    first and last ``EXEC_KEEP`` bytes of each stream; the controller closing the agent's stdin
    ends the command's whole process group."""

    cmd: str
    node_rank: Index
    nnodes: Count
    master_addr: str
    master_port: Port
    session: str
    timeout: float
    nproc_per_node: Count | None = None


@record
class ExecReply(Reply):
    exit_code: ExitCode | None  # None: it did not end by itself (timed out), or never started
    stdout: str  # the head and the tail, with a line saying how much was cut between them
    stderr: str
    stdout_cut: Bytes = 0  # bytes left out of the middle
    stderr_cut: Bytes = 0
    error: str | None = None  # why there is no exit code


@record
class TopRequest(Request):
    """One sample of this node for ``meshkit top``: its CPU, memory, load, network, GPUs and the
    job's ranks. Rates are over the time since this agent's previous sample (the agent keeps the
    previous counters, and nothing else runs between requests); the first request samples twice,
    ``settle`` seconds apart. ``address``: the node as the hostfile names it (its interface is the
    job's); ``job_id`` and ``log``: the job whose ranks to show (empty: none)."""

    address: str
    job_id: str = ""
    log: str = ""
    settle: float = 0.5
    health: HealthRequest | None = None
    window: float = PROGRESS_WINDOW  # seconds the ranks' step rates are taken over


@record
class GpuSample:
    """One GPU; a field the driver does not report is None."""

    index: Index
    name: str
    utilization: float | None  # percent
    memory_used: Bytes | None  # bytes
    memory_total: Bytes | None  # bytes
    power: float | None  # watts
    power_limit: float | None  # watts
    temperature: float | None  # degrees Celsius


@record
class PortRate:
    """A network interface or an InfiniBand port (``mlx5_0:1``): bytes so far and per second."""

    name: str
    received: Bytes
    sent: Bytes
    receive_rate: float | None  # bytes/s since the previous sample (None: the first)
    send_rate: float | None


@record
class RankSample:
    rank: Index
    pid: Pid
    cpu: float | None  # percent of one core since the previous sample
    rss: Bytes  # resident memory, bytes


@record
class TopReply(Reply):
    hostname: str
    cpus: Count
    cpu: float | None  # percent of all cores busy since the previous sample
    memory_used: Bytes  # bytes (total less available)
    memory_total: Bytes
    load: list[float]  # 1, 5 and 15 minutes
    interface: str | None  # the job's interface (its rates are ``ports[0]``'s), when found
    ports: list[PortRate]  # the job's interface first, then InfiniBand ports
    gpus: list[GpuSample]
    gpu_source: str  # "nvml", "nvidia-smi" or "none"
    ranks: list[RankSample]
    job_state: JobState | None = None  # None: no job asked about
    idle: float | None = None  # seconds since the job's log was last written
    gpu_error: str | None = None  # why GPUs could not be read although a driver is there
    job_error: str | None = None  # why the job could not be looked at
    health: NodeHealth | None = None  # when asked
    progress: list[RankProgress] = field(default_factory=list)  # ranks that told their steps


@record
class EventsRequest(Request):
    """A job's history on this node (``meshkit.events``), kept in ``home`` (the job's home on
    this node): ``add`` these events to it, then return those at or after ``since`` (None:
    return nothing), oldest first, at most ``limit`` (``more``: there were more)."""

    job_id: str
    home: str
    add: list[Event] = field(default_factory=list)
    since: WallTime | None = None
    limit: Count = 1000


@record
class EventsReply(Reply):
    events: list[Event]
    more: bool = False


# op -> (request, reply, handler): the handler is "module.function" of meshkit.node, imported on
# first use (a status round needs none of doctor, sync or supervise).
OPS: dict[str, tuple[type[Request], type[Reply], str]] = {
    "env": (EnvRequest, EnvReply, "rankenv.env"),
    "ports": (PortsRequest, PortsReply, "ports.ports"),
    "start": (StartRequest, StartReply, "jobs.start"),
    "jobs": (JobsRequest, JobsReply, "jobs.jobs"),
    "status": (StatusRequest, StatusReply, "jobs.status"),
    "stop": (StopRequest, StopReply, "jobs.stop"),
    "logs": (LogsRequest, LogsReply, "jobs.logs"),
    "diagnose": (DiagnoseRequest, DiagnoseReply, "diagnose.diagnose"),
    "doctor_facts": (FactsRequest, FactsReply, "doctor.facts"),
    "doctor_listen": (ListenRequest, ListenReply, "listeners.listen"),
    "doctor_connect": (ConnectRequest, ConnectReply, "doctor.connect"),
    "doctor_done": (DoneRequest, DoneReply, "doctor.done"),
    "doctor_probe": (ProbeRequest, ProbeReply, "doctor.probe"),
    "doctor_bandwidth": (BandwidthRequest, BandwidthReply, "doctor.bandwidth"),
    "supervisor": (SupervisorRequest, SupervisorReply, "supervise.supervisor"),
    "manifest": (ManifestRequest, ManifestReply, "sync.manifest"),
    "put": (PutRequest, PutReply, "sync.put"),
    "put_files": (PutFilesRequest, PutReply, "sync.put_files"),
    "exec": (ExecRequest, ExecReply, "execute.execute"),
    "top": (TopRequest, TopReply, "top.sample"),
    "health": (HealthRequest, HealthReply, "health.health"),
    "events": (EventsRequest, EventsReply, "events.events"),
}
_OP_OF = {request: op for op, (request, _, _) in OPS.items()}


def op_of(request: Request) -> str:
    return _OP_OF[type(request)]


def encode_request(request: Request) -> str:
    return _line({"v": VERSION, "op": op_of(request), "args": asdict(request)})


def decode_request(line: str) -> tuple[str, Request]:
    data = _load(line)
    op = data.get("op")
    if data.get("v") != VERSION or not isinstance(op, str) or op not in OPS:
        raise ProtocolViolation(f"unknown request {str(op)[:40]!r} (protocol v{data.get('v')})")
    return op, build(OPS[op][0], data.get("args"), "args")


def encode_reply(reply: Reply | None, error: str | None = None) -> str:
    if error is not None:
        return _line({"ok": False, "error": error[:4000]})
    return _line({"ok": True, "result": asdict(reply) if reply else {}})


def decode_reply(op: str, line: str) -> Reply:
    """The reply to ``op``; a node's own error comes back as ``NodeFailure``."""
    data = _load(line)
    if data.get("ok") is False:
        failure = build(Failure, data, "reply")
        raise NodeFailure(failure.error[:4000])
    return build(OPS[op][1], data.get("result"), "result")


@record
class Failure:
    """A reply saying the request failed on the node: its message, checked as any field is."""

    error: str


class NodeFailure(Exception):
    """The agent answered that the request failed on the node (its message)."""


def _line(data: dict[str, object]) -> str:
    try:
        text = json.dumps(data, separators=(",", ":"), allow_nan=False)
    except ValueError as exc:  # NaN or infinity: not JSON, and no reader would take it
        raise ProtocolViolation(f"message not sent: {exc}") from None
    if len(text.encode()) > MAX_LINE:
        raise ProtocolViolation(f"message of {len(text)} bytes exceeds {MAX_LINE}")
    return text + "\n"


def _load(line: str) -> dict[str, Any]:
    if len(line.encode()) > MAX_LINE + 1:
        raise ProtocolViolation(f"line longer than {MAX_LINE} bytes")
    try:
        data = json.loads(line, parse_constant=_no_constant)
    except ValueError as exc:
        raise ProtocolViolation(f"not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ProtocolViolation("not a JSON object")
    return data


def _no_constant(name: str) -> object:
    """JSON has no NaN or infinity (Python's json writes them unless told not to): refused."""
    raise ProtocolViolation(f"{name} is not a number JSON allows")
