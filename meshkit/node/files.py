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

import contextlib
import os
import re
import stat

JOB_ID = re.compile(r"^[0-9a-f]{8,64}$")
SPEC = "spec.json"  # also what the keeper calls the spec when it says why it is unreadable
FLIGHT_PREFIX = "fr-"  # each flight-recorder file of a rank: fr-PID, its dump fr-PID.json
ERROR_PREFIX = "rank"  # a rank's error file: rank<R>.json
ERROR_SUFFIX = ".json"


def state_root() -> str:
    """This user's meshkit state on this node: jobs, supervisors, the ranks' flight-recorder
    FIFOs. In /tmp on purpose: a reboot empties it, so a rebooted node reads the truth."""
    return f"/tmp/meshkit-{os.getuid()}"


class UnsafeStateDir(Exception):
    """A state directory (or one below it) that another user could have written: meshkit uses
    none, and says which, what was found and what to do."""


NEVER = "meshkit never uses a state directory another user can write"


def unsafe(path: str) -> UnsafeStateDir | None:
    """Why the directory ``path`` must not be used (None: it is safe, or it is absent). As
    tmux checks /tmp/tmux-UID: a real directory (not a symlink), this user's, with no write
    bit for group or other."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    remove = f"remove it (rm -rf {path}) and run meshkit again, which makes its own; {NEVER}"
    if stat.S_ISLNK(info.st_mode):
        return UnsafeStateDir(f"the state directory {path} is a symlink: {remove}")
    if not stat.S_ISDIR(info.st_mode):
        return UnsafeStateDir(f"the state directory {path} is not a directory: {remove}")
    if info.st_uid != os.getuid():
        owner = f"owned by uid {info.st_uid}, not by this user (uid {os.getuid()})"
        fix = f"it is not yours: ask its owner or the admin to remove it; {NEVER}"
        return UnsafeStateDir(f"the state directory {path} is {owner}: {fix}")
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o022:
        found = f"mode {mode:04o}, writable by others"
        return UnsafeStateDir(f"the state directory {path} is {found}: {remove}")
    if mode & 0o077:
        # This user's own, and nobody else could write in it (an older meshkit made the root
        # 0755): only the read bits go.
        os.chmod(path, 0o700)
    return None


def levels(path: str) -> list[str]:
    """The state root and each directory below it down to ``path``. A directory outside the
    state root (a test's own ``jobs_root``) is checked from the root that holds it, if any."""
    for top in (state_root(), jobs_root(), supervisors_root()):
        if path == top or path.startswith(f"{top}/"):
            chain = [top]
            for part in path[len(top) :].split("/"):
                if part:
                    chain.append(f"{chain[-1]}/{part}")
            return chain
    return [path]


def check_dir(path: str) -> None:
    """Refuse (``UnsafeStateDir``) if ``path`` or a directory above it up to the state root
    exists and is unsafe. Creates nothing (an absent level holds nothing to trust); the one
    change it makes is taking the read bits off a directory of this user's."""
    for level in levels(path):
        refusal = unsafe(level)
        if refusal is not None:
            raise refusal


def private_dir(path: str) -> str:
    """``path`` (the state root or a directory below it), each missing level created 0700,
    each level checked; returns ``path``. Every directory meshkit uses in its state goes
    through this, never ``os.makedirs(..., exist_ok=True)``, which accepts a directory
    someone else made."""
    for level in levels(path):
        with contextlib.suppress(FileExistsError):  # checked next, whoever made it
            os.mkdir(level, 0o700)
        refusal = unsafe(level)
        if refusal is not None:
            raise refusal
    return path


def check_state() -> None:
    """The state root, ``jobs/`` and ``supervisors/`` (those that exist): the preflight's
    check on every node before anything is started anywhere."""
    check_dir(jobs_root())
    check_dir(supervisors_root())


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


# ---- health: what a job's node first saw, which later reads are compared with


def health_root() -> str:
    return f"{state_root()}/health"


def health_baseline(job_id: str) -> str:
    """The GPU count and InfiniBand error counters this node first read for the job
    (``node.health``): fewer GPUs, or counters risen since, are findings."""
    check_job_id(job_id)
    return f"{health_root()}/{job_id}.json"


# ---- the supervisors: one per job per node


def supervisors_root() -> str:
    return f"{state_root()}/supervisors"


def supervisor_pid_file(job_id: str) -> str:
    """The pid of the job's supervisor on this node, then its heartbeat: a reading of this
    node's monotonic clock (``node.supervise.beat``), not the file's mtime."""
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


def progress_dir(directory: str) -> str:
    """Where the job's ranks on this node write their progress (``meshkit.progress``), in the
    job's state directory ``directory``: the keeper makes it (0700) and passes it to the ranks
    as MESHKIT_PROGRESS. Its files are named as error files are (``rank_error_file``)."""
    return f"{directory}/progress"


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


NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW


def temporary_name(path: str) -> str:
    """A temporary file's name beside ``path`` that nobody can guess in advance."""
    head, name = os.path.split(path)
    return os.path.join(head, f".{name}.{os.getpid()}.{os.urandom(8).hex()}")


def write_atomic(path: str | os.PathLike[str], data: str | bytes, mode: int = 0o600) -> None:
    """Write ``path`` whole or not at all: readers never see it half-written. The temporary is
    new (``O_EXCL|O_NOFOLLOW``, an unguessable name): whatever is planted at a name is never
    followed or written through."""
    path = os.fspath(path)
    temporary = temporary_name(path)
    descriptor = os.open(temporary, NEW_FILE, mode)
    try:
        with os.fdopen(descriptor, "wb") as out:
            out.write(data.encode() if isinstance(data, str) else data)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
