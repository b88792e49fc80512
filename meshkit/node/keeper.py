"""The keeper: one per job per node, the process tmux runs. It is a child subreaper, so whatever
the job starts (``setsid``, double forks, ``env -i``) stays in its process tree for ``stop`` to
find; it runs the job's command, records when it started and how it exited, and stays until the
last of the job's processes is gone. Standard library only.
"""

from __future__ import annotations

import marshal
import os
import time

from . import procs, signals
from .files import write_atomic
from .inprocess import run_meshkit

TYPE_CHECKING = False
if TYPE_CHECKING:
    from types import FrameType

MAX_SPEC = 1 << 20  # bytes of the spec (the agent wrote it from a request of at most a line)
SPEC = "spec.marshal"


class Spec:
    """What the keeper needs of the job: the agent wrote it (``jobs.keeper_spec``) from a request
    it had checked against the protocol, as this interpreter's own ``marshal`` data in the job's
    private (0700) state directory, with the bash script already built. The keeper checks the
    types again by hand. Not JSON, shlex or the protocol: the keeper is one more interpreter on
    every node at every launch, and those imports (``re`` above all) were most of its start-up."""

    def __init__(self, data: object) -> None:
        if not isinstance(data, dict):
            raise ValueError("not a mapping")
        self.job_id = _str(data, "job_id")
        self.session = _str(data, "session")
        self.workdir = _str(data, "workdir")
        self.script = _str(data, "script")
        # Set when the script is exactly `THIS_PYTHON -m meshkit ARGS` (no setup lines, nothing
        # in env that changes how Python starts): ARGS, run in a fork of this keeper.
        meshkit = data.get("meshkit")
        if meshkit is not None and not (
            isinstance(meshkit, list) and all(isinstance(a, str) for a in meshkit)
        ):
            raise ValueError("meshkit: expected a list of strings")
        self.meshkit: list[str] | None = meshkit
        env = data.get("env", {})
        if not isinstance(env, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in env.items()
        ):
            raise ValueError("env: expected a mapping of strings")
        self.env: dict[str, str] = env


def _str(data: dict[str, object], key: str) -> str:
    value = data.get(key)
    if not isinstance(value, str):
        raise ValueError(f"{key}: expected a string")
    return value


def keep(directory: str) -> int:
    d = directory
    try:
        with open(f"{d}/{SPEC}", "rb") as handle:
            job = Spec(marshal.loads(handle.read(MAX_SPEC)))
    except (OSError, ValueError, EOFError, TypeError) as exc:
        write_atomic(f"{d}/error", f"unreadable job spec: {exc}\n")
        write_atomic(f"{d}/exit", "2\n")
        return 2
    procs.become_subreaper()
    # tmux kill-session sends SIGHUP: the stop op ends the job's processes itself, children first,
    # so that nothing is orphaned out of this tree before it is signalled.
    signals.signal(signals.SIGHUP, signals.SIG_IGN)
    signals.signal(signals.SIGINT, signals.SIG_IGN)
    signals.signal(signals.SIGTERM, _forward)
    write_atomic(f"{d}/keeper.pid", f"{os.getpid()}\n")
    write_atomic(f"{d}/started", f"{time.time():.3f}\n")
    env = {
        **os.environ,
        **job.env,
        procs.JOB_TAG: job.job_id,
        procs.SESSION_TAG: job.session,
    }
    try:
        os.chdir(job.workdir)
        child = _run_meshkit(job, env) if job.meshkit is not None else _spawn_bash(job, env)
    except OSError as exc:
        write_atomic(f"{d}/error", f"cannot start in {job.workdir}: {exc.strerror or exc}\n")
        write_atomic(f"{d}/exit", "127\n")
        return 127
    code = 0
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            return code  # the command and every straggler it left are gone
        except InterruptedError:
            continue
        if pid == child:
            code = os.waitstatus_to_exitcode(status)
            code = 128 - code if code < 0 else code  # killed by a signal: as a shell reports it
            write_atomic(f"{d}/exit", f"{code}\n")


def _spawn_bash(job: Spec, env: dict[str, str]) -> int:
    """``bash -c SCRIPT``. posix_spawn, not subprocess (whose import costs every node ms at every
    launch). Like Popen's restore_signals, the job gets SIGPIPE and SIGXFSZ back at their defaults
    (Python ignores them); what this keeper ignores on purpose it inherits, as it did under Popen."""
    return os.posix_spawnp(
        "bash", ["bash", "-c", job.script], env, setsigdef=signals.RESET_FOR_EXEC
    )


def _run_meshkit(job: Spec, env: dict[str, str]) -> int:
    """``meshkit ARGS`` (``run``: discover, then exec the command) in a fork of this keeper, as a
    new ``python -m meshkit`` from ``bash -c`` would run it, without a second interpreter's start
    (about 10 ms of CPU per node at every launch). The child gets what that interpreter would
    have: the job's environment, TERM at its default, HUP and INT ignored as the keeper ignores
    them; ``meshkit run`` gives the command SIGPIPE and SIGXFSZ at their defaults."""
    pid = os.fork()
    if pid == 0:
        try:
            signals.signal(signals.SIGTERM, signals.SIG_DFL)
            os.environ.update(env)
        except BaseException:
            os._exit(127)
        run_meshkit(job.workdir, job.meshkit or [])
    return pid


def _forward(signum: int, frame: FrameType | None) -> None:
    """TERM for the keeper is TERM for the job: pass it on and keep holding the tree."""
    procs.signal_all(procs.descendants(os.getpid()), signals.SIGTERM)
