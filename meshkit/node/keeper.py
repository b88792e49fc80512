"""The keeper: one per job per node, the process tmux runs. It is a child subreaper, so whatever
the job starts (``setsid``, double forks, ``env -i``) stays in its process tree for ``stop`` to
find; it runs the job's command, records when it started and how it exited, and stays until the
last of the job's processes is gone. It also reads its ranks' stacks for ``meshkit diagnose``
(``node/diagnose.answer``): under Yama's ``ptrace_scope`` 1 only a process's ancestors may trace it,
and what they start once it names one its tracer (the rank hook names the keeper); the agent,
under sshd, is neither. Standard library only.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time

from ..protocol import NodeJob
from ..record import Invalid, build
from . import files, procs, signals

TYPE_CHECKING = False
if TYPE_CHECKING:
    from types import FrameType

TRACER = "MESHKIT_KEEPER"  # the keeper's pid, for the rank hook's PR_SET_PTRACER
PROGRESS = "MESHKIT_PROGRESS"  # where the ranks write their progress (meshkit.progress)
MAX_SPEC = 1 << 20  # bytes of the spec (the agent wrote it from a request of at most a line)


def _progress_dir(directory: str) -> str:
    """The ranks' progress directory, made private and emptied of an earlier attempt's files:
    what is there after this start is this attempt's ("": none could be made, and the ranks'
    ``meshkit.progress`` does nothing)."""
    try:
        progress = files.private_dir(files.progress_dir(directory))
        names = os.listdir(progress)
    except (OSError, files.UnsafeStateDir):
        return ""
    for name in names:
        if files.error_file_rank(name) is not None:
            with contextlib.suppress(OSError):
                os.unlink(f"{progress}/{name}")
    return progress


def keep(directory: str) -> int:
    # A directory another user could write is refused (UnsafeStateDir) before anything in it is
    # read or written: its spec may be theirs.
    files.check_dir(directory)
    try:
        # The agent wrote it from a request it had checked; checked again, as any file read.
        with open(files.spec_file(directory), "rb") as handle:
            job = build(NodeJob, json.loads(handle.read(MAX_SPEC)), files.SPEC)
    except (OSError, ValueError, Invalid) as exc:
        files.write_atomic(files.error_file(directory), f"unreadable job spec: {exc}\n")
        files.write_atomic(files.exit_file(directory), "2\n")
        return 2
    procs.become_subreaper()
    # tmux kill-session sends SIGHUP: the stop op ends the job's processes itself, children first,
    # so that nothing is orphaned out of this tree before it is signalled.
    signals.signal(signals.SIGHUP, signals.SIG_IGN)
    signals.signal(signals.SIGINT, signals.SIG_IGN)
    signals.signal(signals.SIGTERM, _forward)
    _listen(files.stacks_socket(directory))
    files.write_atomic(files.keeper_pid_file(directory), f"{os.getpid()}\n")
    files.write_atomic(files.started_file(directory), f"{time.time():.3f}\n")
    tags = {
        procs.JOB_TAG: job.job_id,
        procs.SESSION_TAG: job.session,
        TRACER: str(os.getpid()),
        PROGRESS: _progress_dir(directory),
    }
    env = {**os.environ, **job.env, **tags}
    try:
        os.chdir(job.workdir)
        # posix_spawn, not subprocess. Like Popen's restore_signals, the job gets SIGPIPE and
        # SIGXFSZ back at their defaults (Python ignores them); what this keeper ignores on
        # purpose (HUP, INT) it inherits.
        child = os.posix_spawnp(
            "bash", ["bash", "-c", job.script()], env, setsigdef=signals.RESET_FOR_EXEC
        )
    except OSError as exc:
        why = f"cannot start in {job.workdir}: {exc.strerror or exc}\n"
        files.write_atomic(files.error_file(directory), why)
        files.write_atomic(files.exit_file(directory), "127\n")
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
            code = signals.exit_code(status)
            files.write_atomic(files.exit_file(directory), f"{code}\n")


def _listen(path: str) -> None:
    """Answer each connection on ``path`` in a thread of its own (``diagnose.answer``)."""
    server = socket.socket(socket.AF_UNIX)
    try:
        if os.path.lexists(path):
            os.unlink(path)  # the previous attempt's
        server.bind(path)
        server.listen(64)
    except OSError:
        return  # the job runs anyway; diagnose says it could not ask this keeper

    def accept() -> None:
        while True:
            try:
                connection, _ = server.accept()
            except OSError:
                return  # out of descriptors: diagnose says it could not ask this keeper
            from .diagnose import answer  # at the first question, not at every launch

            threading.Thread(target=answer, args=(connection,), daemon=True).start()

    threading.Thread(target=accept, name="meshkit-stacks", daemon=True).start()


def _forward(signum: int, frame: FrameType | None) -> None:
    """TERM for the keeper is TERM for the job: pass it on and keep holding the tree."""
    procs.signal_all(procs.descendants(os.getpid()), signals.SIGTERM)
