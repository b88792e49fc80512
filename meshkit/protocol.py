"""What the controller and a node agent say to each other: typed requests and replies, one JSON
object per line over the stdin/stdout of a single exec channel.

Standard library only: the node side imports this too. Both sides bound what they read (a line is
at most ``MAX_LINE`` bytes) and check every field's type, so a reply from a node is data, never
trusted structure. Adding an op = a request class, a reply class and an entry in ``OPS``.
"""

from __future__ import annotations

import json

from .record import MISSING, Field, asdict, field, fields, is_record, record

TYPE_CHECKING = False  # no runtime `typing`: every agent imports this module (see record.py)
if TYPE_CHECKING:
    from typing import Any, TypeVar, Union

    T = TypeVar("T")

VERSION = 1
MAX_LINE = 1 << 20  # bytes in one request or reply line
MAX_LOG_BYTES = 256 * 1024  # log bytes one `logs` reply carries


class ProtocolViolation(ValueError):
    """A line that is not a well-formed request or reply."""


# ---- requests and replies ---------------------------------------------------------------------


@record
class EnvRequest:
    """Run ``meshkit env --json ...`` (``argv``) in ``cwd``, as a login there would."""

    cwd: str
    argv: list[str]


@record
class EnvReply:
    code: int
    out: str
    err: str


@record
class PortsRequest:
    """Which of ``ports`` a TCP listener could bind here; ``job_id``'s own job may hold one."""

    job_id: str
    ports: list[int]


@record
class PortState:
    port: int
    free: bool


@record
class PortsReply:
    ports: list[PortState]
    ours: bool  # the job asked about is running here (so its port is about to be freed)


@record
class NodeJob:
    """What a node needs to run its part of a job (the same on every node: each node discovers
    its own rank). ``argv`` is ``meshkit run ...``; ``env`` and ``setup`` come from config."""

    job_id: str
    session: str
    label: str  # how messages name the job: "SESSION in WORKDIR"
    workdir: str
    tmux_session: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    setup: list[str] = field(default_factory=list)


@record
class RunningJob:
    job_id: str
    label: str


@record
class StartRequest:
    job: NodeJob
    replace: bool = False  # end other meshkit jobs running here (never without the user's say)


@record
class StartReply:
    started: bool
    state: str  # "running" | "exited" | "absent"
    replaced: list[RunningJob]
    conflicts: list[RunningJob]
    error: str | None = None


@record
class JobsRequest:
    """The meshkit jobs running on this node."""


@record
class JobsReply:
    running: list[RunningJob]


@record
class StatusRequest:
    job_id: str
    log: str


@record
class StatusReply:
    state: str  # "running" | "exited" | "absent"
    exit_code: int | None
    started: float | None
    last_line: str | None


@record
class StopRequest:
    job_id: str
    keep_exit: bool = False  # leave the exit record (a supervisor giving up keeps exit codes)


@record
class StopReply:
    found: bool  # the job had a keeper (or processes) here
    signalled: int
    left: list[int]  # processes of the job still alive after TERM and KILL (looked, not assumed)


@record
class LogsRequest:
    """The last ``lines`` lines of ``path``, or (``offset`` given) what was appended since."""

    path: str
    lines: int = 20
    offset: int | None = None


@record
class LogsReply:
    lines: list[str]
    offset: int  # where the next `follow` read starts
    missing: bool = False


# ---- doctor: node-side checks (meshkit/node/doctor.py) ----------------------------------------


@record
class FactsRequest:
    """Versions, GPUs, clock and the workdir: the master writes ``marker`` (holding ``token``)
    first, the other nodes then look for it (the workdir is shared if they all see it)."""

    workdir: str
    marker: str
    token: str
    write_marker: bool


@record
class FactsReply:
    hostname: str
    python: str
    meshkit: str
    torch: str | None
    cuda: str | None
    nccl: str | None
    gpus: int
    clock: float  # time.time() on the node when it answered
    writable: str | None  # None: the workdir is writable; else why not
    marker: str  # "written" | "seen" | why not


@record
class ListenRequest:
    """A short-lived TCP listener: on ``ifname``'s IPv4 address (None: every address) and
    ``port`` (0: any free one); it closes by itself after ``seconds``."""

    ifname: str | None
    port: int
    seconds: float


@record
class ListenReply:
    address: str
    port: int
    error: str | None  # why it could not listen (a busy port names its holder when known)


@record
class ProbeTarget:
    label: str
    host: str
    port: int


@record
class ConnectRequest:
    """TCP connect to every target at once, retried until ``seconds`` have passed."""

    targets: list[ProbeTarget]
    seconds: float


@record
class ConnectResult:
    label: str
    port: int
    ok: bool
    detail: str


@record
class ConnectReply:
    results: list[ConnectResult]


@record
class DoneRequest:
    """Close this agent's doctor listeners; remove ``marker`` when given."""

    marker: str | None = None


@record
class DoneReply:
    closed: int


@record
class ProbeRequest:
    """Run ``argv`` (``meshkit run --cmd <collective probe>``) in ``cwd``, bounded by ``seconds``."""

    cwd: str
    argv: list[str]
    seconds: float


OPS: dict[str, tuple[type[Any], type[Any]]] = {
    "env": (EnvRequest, EnvReply),
    "ports": (PortsRequest, PortsReply),
    "start": (StartRequest, StartReply),
    "jobs": (JobsRequest, JobsReply),
    "status": (StatusRequest, StatusReply),
    "stop": (StopRequest, StopReply),
    "logs": (LogsRequest, LogsReply),
    "doctor_facts": (FactsRequest, FactsReply),
    "doctor_listen": (ListenRequest, ListenReply),
    "doctor_connect": (ConnectRequest, ConnectReply),
    "doctor_done": (DoneRequest, DoneReply),
    "doctor_probe": (ProbeRequest, EnvReply),
}


# ---- supervision and sync (issue 13) ----------------------------------------------------------


@record
class UnsuperviseRequest:
    """End the supervisor of ``job_id`` if it runs on this node."""

    job_id: str
    tmux_session: str


@record
class UnsuperviseReply:
    found: bool
    left: list[int]


@record
class ManifestRequest:
    """Size and mtime of every file under ``root`` (relative paths), ``exclude`` names skipped."""

    root: str
    exclude: list[str] = field(default_factory=list)


@record
class FileState:
    path: str
    size: int
    mtime: float
    mode: int


@record
class ManifestReply:
    exists: bool
    files: list[FileState]
    truncated: bool = False


@record
class PutRequest:
    """A chunk of a file (base64 ``data`` at ``offset``); ``last`` moves it into place with
    ``mode`` and ``mtime`` (until then it is a hidden temporary beside it)."""

    path: str
    data: str
    offset: int
    last: bool
    mode: int = 0o644
    mtime: float = 0.0


@record
class PutReply:
    written: int


SUPERVISE_OPS: dict[str, tuple[type[Any], type[Any]]] = {
    "unsupervise": (UnsuperviseRequest, UnsuperviseReply),
    "manifest": (ManifestRequest, ManifestReply),
    "put": (PutRequest, PutReply),
}
OPS.update(SUPERVISE_OPS)
_OP_OF = {req: op for op, (req, _) in OPS.items()}

if TYPE_CHECKING:
    Request = Union[
        EnvRequest,
        PortsRequest,
        StartRequest,
        JobsRequest,
        StatusRequest,
        StopRequest,
        LogsRequest,
        FactsRequest,
        ListenRequest,
        ConnectRequest,
        DoneRequest,
        ProbeRequest,
        "UnsuperviseRequest",
        "ManifestRequest",
        "PutRequest",
    ]
    Reply = Union[
        EnvReply,
        PortsReply,
        StartReply,
        JobsReply,
        StatusReply,
        StopReply,
        LogsReply,
        FactsReply,
        ListenReply,
        ConnectReply,
        DoneReply,
        "UnsuperviseReply",
        "ManifestReply",
        "PutReply",
    ]
else:  # the aliases only annotate; at runtime any name will do
    Request = Reply = object


def op_of(request: Request) -> str:
    return _OP_OF[type(request)]


# ---- encoding ---------------------------------------------------------------------------------


def encode_request(request: Request) -> str:
    op = _OP_OF[type(request)]
    return _line({"v": VERSION, "op": op, "args": asdict(request)})


def decode_request(line: str) -> tuple[str, Request]:
    data = _load(line)
    op = data.get("op")
    if data.get("v") != VERSION or not isinstance(op, str) or op not in OPS:
        raise ProtocolViolation(f"unknown request {str(op)[:40]!r} (protocol v{data.get('v')})")
    request: Request = build(OPS[op][0], data.get("args"), "args")
    return op, request


def encode_reply(reply: Reply | None, error: str | None = None) -> str:
    if error is not None:
        return _line({"ok": False, "error": error[:4000]})
    return _line({"ok": True, "result": asdict(reply) if reply else {}})


def decode_reply(op: str, line: str) -> Reply:
    """The reply to ``op``; a node's own error comes back as ``NodeFailure``."""
    data = _load(line)
    if data.get("ok") is False:
        raise NodeFailure(str(data.get("error"))[:4000])
    reply: Reply = build(OPS[op][1], data.get("result"), "result")
    return reply


class NodeFailure(Exception):
    """The agent answered that the request failed on the node (its message)."""


def _line(data: dict[str, object]) -> str:
    text = json.dumps(data, separators=(",", ":"))
    if len(text.encode()) > MAX_LINE:
        raise ProtocolViolation(f"message of {len(text)} bytes exceeds {MAX_LINE}")
    return text + "\n"


def _load(line: str) -> dict[str, Any]:
    if len(line.encode()) > MAX_LINE + 1:
        raise ProtocolViolation(f"line longer than {MAX_LINE} bytes")
    try:
        data = json.loads(line)
    except ValueError as exc:
        raise ProtocolViolation(f"not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ProtocolViolation("not a JSON object")
    return data


def build(cls: type[T], data: object, where: str) -> T:
    """A record from JSON, checking every field against its annotation."""
    if not isinstance(data, dict):
        raise ProtocolViolation(f"{where}: expected an object")
    values = {}
    for f, shape in _fields_of(cls):
        if f.name in data:
            values[f.name] = _check(shape, data[f.name], f"{where}.{f.name}")
        elif f.default is MISSING and f.default_factory is MISSING:
            raise ProtocolViolation(f"{where}.{f.name}: missing")
    return cls(**values)


class _Shape:
    """A field's annotation, parsed once: ``tag`` is a scalar type's name, ``list``, ``dict``,
    ``union`` or ``record`` (then ``record`` is the class)."""

    __slots__ = ("args", "record", "tag")

    def __init__(self, tag: str, args: tuple[_Shape, ...] = (), record: type | None = None) -> None:
        self.tag = tag
        self.args = args
        self.record = record


_SHAPES: dict[type, tuple[tuple[Field, _Shape], ...]] = {}
_SCALARS = ("str", "int", "float", "bool", "None")


def _fields_of(cls: type) -> tuple[tuple[Field, _Shape], ...]:
    found = _SHAPES.get(cls)
    if found is None:
        found = _SHAPES[cls] = tuple((f, _shape(f.type)) for f in fields(cls))
    return found


def _shape(text: str) -> _Shape:
    """The shape of an annotation string (``list[int]``, ``str | None``, ``dict[str, str]``, a
    record of this module); the protocol's annotations use nothing else (a test parses them all)."""
    options = _split(text, "|")
    if len(options) > 1:
        return _Shape("union", tuple(_shape(option) for option in options))
    text = text.strip()
    if text.endswith("]"):
        head, _, inner = text[:-1].partition("[")
        args = tuple(_shape(arg) for arg in _split(inner, ","))
        if (head, len(args)) in (("list", 1), ("dict", 2)):
            return _Shape(head, args)
    elif text in _SCALARS:
        return _Shape(text)
    else:
        found = globals().get(text)
        if isinstance(found, type) and is_record(found):
            return _Shape("record", record=found)
    raise TypeError(f"protocol: unsupported annotation {text!r}")


def _split(text: str, sep: str) -> list[str]:
    """``text`` cut at ``sep`` outside brackets."""
    parts, depth, start = [], 0, 0
    for at, char in enumerate(text):
        depth += (char == "[") - (char == "]")
        if char == sep and depth == 0:
            parts.append(text[start:at])
            start = at + 1
    parts.append(text[start:])
    return parts


def _check(shape: _Shape, value: object, where: str) -> object:
    tag = shape.tag
    if tag == "union":
        for option in shape.args:
            try:
                return _check(option, value, where)
            except ProtocolViolation:
                continue
        raise ProtocolViolation(f"{where}: unexpected {type(value).__name__}")
    if tag == "None":
        if value is None:
            return None
    elif tag == "list":
        if isinstance(value, list):
            (item,) = shape.args
            return [_check(item, v, f"{where}[]") for v in value]
    elif tag == "dict":
        if isinstance(value, dict):
            key, val = shape.args
            return {_check(key, k, where): _check(val, v, where) for k, v in value.items()}
    elif tag == "record":
        assert shape.record is not None
        return build(shape.record, value, where)
    elif tag == "float":
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tag == "int":
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif (tag == "str" and isinstance(value, str)) or (tag == "bool" and isinstance(value, bool)):
        return value
    raise ProtocolViolation(f"{where}: unexpected {type(value).__name__}")
