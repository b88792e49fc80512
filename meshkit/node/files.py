"""The node's state files, each named here and nowhere else: a job's state directory and
what it holds, the supervisors' pid files and record copies, the ranks' flight-recorder FIFOs
and the error files the rank hook writes; and the two helpers that read and write them.

Standard library only: the keeper imports this on every node at every launch. Paths are
strings (``os.path``, not ``pathlib``, whose import every node interpreter would pay).

The rank hook (``node/hook/sitecustomize.py``) imports nothing of meshkit into the user's
ranks: it builds the FIFO and error-file paths by the same convention, and
``tests/test_nodefiles.py`` checks that its paths are these.
"""

from __future__ import annotations

import os
import re

JOB_ID = re.compile(r"^[0-9a-f]{8,64}$")
SPEC = "spec.json"  # also what the keeper calls the spec when it says why it is unreadable
FLIGHT_PREFIX = "fr-"  # each flight-recorder file of a rank: fr-PID, its dump fr-PID.json
ERROR_PREFIX = "rank"  # a rank's error file: rank<R>.json
ERROR_SUFFIX = ".json"


def state_root() -> str:
    """This user's meshkit state on this node: jobs, supervisors, the ranks' flight-recorder
    FIFOs. In /tmp on purpose: a reboot empties it, so a rebooted node reads the truth."""
    return f"/tmp/meshkit-{os.getuid()}"


def check_job_id(job_id: str) -> None:
    """A job id arrives in a request: it becomes part of a path only when it is one."""
    if not JOB_ID.match(job_id):
        raise ValueError(f"bad job id {job_id[:40]!r}")


# ---- a job's state directory: each job's own, on each node


def jobs_root() -> str:
    return f"{state_root()}/jobs"


def job_dir(job_id: str) -> str:
    check_job_id(job_id)
    return f"{jobs_root()}/{job_id}"


def spec_file(directory: str) -> str:
    """The job's one record (``protocol.NodeJob``): the agent writes it; the keeper runs
    it."""
    return f"{directory}/{SPEC}"


def stacks_socket(directory: str) -> str:
    """Where the keeper answers the agent's questions for a rank's stack."""
    return f"{directory}/stacks.sock"


def keeper_pid_file(directory: str) -> str:
    return f"{directory}/keeper.pid"


def started_file(directory: str) -> str:
    """When the keeper started the job's current attempt, by this node's clock."""
    return f"{directory}/started"


def exit_file(directory: str) -> str:
    """The job's command's exit code, once it has exited."""
    return f"{directory}/exit"


def error_file(directory: str) -> str:
    """Why the keeper could not start the job's command."""
    return f"{directory}/error"


# ---- the supervisors: one per job per node


def supervisors_root() -> str:
    return f"{state_root()}/supervisors"


def supervisor_pid_file(job_id: str) -> str:
    """The pid of the job's supervisor on this node; its mtime is the supervisor's
    heartbeat."""
    check_job_id(job_id)
    return os.path.join(supervisors_root(), f"{job_id}.pid")


def supervision_copy(job_id: str) -> str:
    """This node's copy of the job's supervision record."""
    check_job_id(job_id)
    return os.path.join(supervisors_root(), f"{job_id}.json")


def supervision_lock(job_id: str) -> str:
    """Held while the copy is compared and set: one writer at a time on this node."""
    return f"{supervision_copy(job_id)}.lock"


# ---- a rank's files: written by the rank hook


def fifo(pid: int) -> str:
    """The flight-recorder FIFO of the rank process ``pid``."""
    return f"{state_root()}/{FLIGHT_PREFIX}{pid}"


def fifo_dump(fifo_path: str) -> str:
    """Where the rank writes its flight recorder's JSON when the keeper opens its FIFO."""
    return f"{fifo_path}.json"


def flight_file_pid(name: str) -> str | None:
    """The pid part of a flight-recorder file's name in ``state_root()`` (``fr-PID``,
    ``fr-PID.json``, ...), not checked to be a number; None for any other name."""
    if not name.startswith(FLIGHT_PREFIX):
        return None
    return name[len(FLIGHT_PREFIX) :].partition(".")[0]


def errors_dir(home: str) -> str:
    """Where a job's ranks record their uncaught exceptions: beside its logs in ``home``, on
    the storage the nodes share (``meshkit run --log`` passes it to the ranks as
    MESHKIT_ERRORS)."""
    return os.path.join(home, "errors")


def rank_error_file(errors: str, rank: int | str) -> str:
    return f"{errors}/{ERROR_PREFIX}{rank}{ERROR_SUFFIX}"


def error_file_rank(name: str) -> str | None:
    """The rank part of an error file's name in ``errors_dir`` (not checked to be a number);
    None for any other name."""
    if not name.startswith(ERROR_PREFIX):
        return None
    if not name.endswith(ERROR_SUFFIX):
        return None
    return name[len(ERROR_PREFIX) : -len(ERROR_SUFFIX)]


# ---- reading and writing them


def read_text(path: str | os.PathLike[str], limit: int = 65536) -> str | None:
    """At most ``limit`` bytes of ``path`` (None when it cannot be read)."""
    try:
        with open(path, "rb") as handle:
            return handle.read(limit).decode(errors="replace")
    except OSError:
        return None


def write_atomic(path: str | os.PathLike[str], data: str | bytes, mode: int = 0o600) -> None:
    """Write ``path`` whole or not at all: readers never see it half-written."""
    path = os.fspath(path)
    head, name = os.path.split(path)
    temporary = os.path.join(head, f".{name}.{os.getpid()}")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(descriptor, "wb") as out:
        out.write(data.encode() if isinstance(data, str) else data)
    os.replace(temporary, path)
