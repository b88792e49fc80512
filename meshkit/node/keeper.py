"""The keeper: one per job per node, the process tmux runs. It is a child subreaper, so whatever
the job starts (``setsid``, double forks, ``env -i``) stays in its process tree for ``stop`` to
find; it runs the job's command, records when it started and how it exited, and stays until the
last of the job's processes is gone. Standard library only.
"""

from __future__ import annotations

import marshal
import os
import signal
import time

from . import procs
from .files import write_atomic

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
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _forward)
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
        # posix_spawn, not subprocess (whose import costs every node ms at every launch). Like
        # Popen's restore_signals, the job gets SIGPIPE and SIGXFSZ back at their defaults (Python
        # ignores them); what this keeper ignores on purpose it inherits, as it did under Popen.
        child = os.posix_spawnp(
            "bash",
            ["bash", "-c", job.script],
            env,
            setsigdef=(signal.SIGPIPE, signal.SIGXFSZ),
        )
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


def _forward(signum: int, frame: FrameType | None) -> None:
    """TERM for the keeper is TERM for the job: pass it on and keep holding the tree."""
    procs.signal_all(procs.descendants(os.getpid()), signal.SIGTERM)
