"""The keeper: one per job per node, the process tmux runs. It is a child subreaper, so whatever
the job starts (``setsid``, double forks, ``env -i``) stays in its process tree for ``stop`` to
find; it runs the job's command, records when it started and how it exited, and stays until the
last of the job's processes is gone. Standard library only.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import time
from pathlib import Path
from types import FrameType

from ..protocol import NodeJob, ProtocolViolation, build
from . import procs
from .jobs import write_atomic


def keep(directory: str) -> int:
    d = Path(directory)
    try:
        job = build(NodeJob, json.loads((d / "spec.json").read_text()), "spec")
    except (OSError, ValueError, ProtocolViolation) as exc:
        write_atomic(d / "error", f"unreadable job spec: {exc}\n")
        write_atomic(d / "exit", "2\n")
        return 2
    procs.become_subreaper()
    # tmux kill-session sends SIGHUP: the stop op ends the job's processes itself, children first,
    # so that nothing is orphaned out of this tree before it is signalled.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _forward)
    write_atomic(d / "keeper.pid", f"{os.getpid()}\n")
    write_atomic(d / "started", f"{time.time():.3f}\n")
    env = {
        **os.environ,
        **job.env,
        procs.JOB_TAG: job.job_id,
        procs.SESSION_TAG: job.session,
    }
    script = "\n".join([*job.setup, shlex.join(job.argv)]) + "\n"
    try:
        os.chdir(job.workdir)
        child = subprocess.Popen(["bash", "-c", script], env=env)
    except OSError as exc:
        write_atomic(d / "error", f"cannot start in {job.workdir}: {exc.strerror or exc}\n")
        write_atomic(d / "exit", "127\n")
        return 127
    code = 0
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            return code  # the command and every straggler it left are gone
        except InterruptedError:
            continue
        if pid == child.pid:
            code = os.waitstatus_to_exitcode(status)
            code = 128 - code if code < 0 else code  # killed by a signal: as a shell reports it
            write_atomic(d / "exit", f"{code}\n")


def _forward(signum: int, frame: FrameType | None) -> None:
    """TERM for the keeper is TERM for the job: pass it on and keep holding the tree."""
    procs.signal_all(procs.descendants(os.getpid()), signal.SIGTERM)
