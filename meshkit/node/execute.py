"""The ``exec`` op: one command on this node for ``meshkit exec``, with the node's ``meshkit env``
variables, bounded in time and in what it keeps of its output, and ended with its whole process
group when the controller leaves. Standard library only; imported at the first ``exec`` request.

Bounded here, on the node, so that gigabytes of output never cross the wire: each stream keeps
its first and last ``EXEC_KEEP`` bytes and counts what it left out between them.
"""

from __future__ import annotations

import contextlib
import os
import select
import subprocess
import sys
import time

from ..distenv import NodeEnv, combine, environment
from ..errors import MeshkitError
from ..protocol import EXEC_KEEP, ExecReply, ExecRequest
from ..sources import Placement
from .procs import in_group
from .signals import SIGKILL, SIGTERM

TYPE_CHECKING = False  # no runtime `typing` on the node side (see meshkit/record.py)
if TYPE_CHECKING:
    from typing import IO

F_SETPIPE_SZ = 1031  # fcntl's name for it is Linux-only (Python 3.10+)
READ_BYTES = 1 << 20  # one read from a stream: a node printing gigabytes costs few reads
POLL_S = 0.2  # how often a quiet command looks at the time and at the controller
GRACE_S = 1.0  # between SIGTERM and SIGKILL for the command's process group


class Kept:
    """One stream's output, bounded: its first ``limit`` bytes, its last ``limit`` bytes, and how
    many were seen in all."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.head = bytearray()
        self.tail = bytearray()
        self.seen = 0

    def add(self, data: bytes) -> None:
        self.seen += len(data)
        room = self.limit - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if len(data) >= self.limit:
            self.tail = bytearray(data[-self.limit :])
        elif data:
            self.tail += data
            del self.tail[: len(self.tail) - self.limit]

    @property
    def cut(self) -> int:
        """Bytes left out between the head and the tail."""
        return self.seen - len(self.head) - len(self.tail)

    def text(self) -> str:
        """What was kept, as text; where bytes were left out, a line says how many."""
        if not self.cut:  # one text: a character may straddle the head and the tail
            return (self.head + self.tail).decode(errors="replace")
        head = self.head.decode(errors="replace")
        tail = self.tail.decode(errors="replace")
        if not head.endswith("\n"):
            head += "\n"
        return f"{head}[meshkit exec: {self.cut} bytes cut]\n{tail}"


def execute(request: ExecRequest) -> ExecReply:
    """Run the request's command; the agent's stdin is watched: it closes when the controller
    leaves (Ctrl-C, a lost connection), and then the command's process group is ended."""
    return run(request, sys.stdin.fileno())


def run(request: ExecRequest, watched: int | None) -> ExecReply:
    """``request``'s command to its end (or its timeout, or ``watched`` closing: the fd of a
    stream that carries nothing while a request is served, so any event on it means the other
    end is gone)."""
    try:
        env = environment(_node(request), os.environ, sys.executable)
    except MeshkitError as exc:
        return ExecReply(None, "", "", error=f"meshkit env failed here: {exc}")
    try:
        # --norc: bash would read ~/.bashrc again (sshd's SSH_CLIENT is in the environment),
        # after the login shell that started this agent read it: a second shell start on
        # every node, and what it exports would override the variables just set.
        process = subprocess.Popen(
            ["bash", "--norc", "-c", request.cmd],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            start_new_session=True,  # its own process group: ended as one
        )
    except OSError as exc:
        return ExecReply(None, "", "", error=f"bash could not start: {exc}")
    stdout = Kept(EXEC_KEEP)
    stderr = Kept(EXEC_KEEP)
    streams = {_fd(process.stdout): stdout, _fd(process.stderr): stderr}
    for fd in streams:
        _widen(fd)
    why = _gather(process, streams, request.timeout, watched)
    if why is not None:
        _end_group(process)
    for stream in (process.stdout, process.stderr):
        if stream is not None:
            stream.close()
    code = process.returncode
    if why is not None:
        code = None
    elif code is not None and code < 0:
        code = 128 - code  # as a shell reports a signal: 128 + N
    return ExecReply(code, stdout.text(), stderr.text(), stdout.cut, stderr.cut, why)


def _node(request: ExecRequest) -> NodeEnv:
    """What ``meshkit env --node-rank R`` says here for the controller's hostfile."""
    from ..discovery import with_interface  # its address lookups: only where a command runs
    from ..localnet import gpu_count

    placement = Placement(
        "explicit",
        request.node_rank,
        nnodes=request.nnodes,
        master_addr=request.master_addr,
        master_port=request.master_port,
        nproc_per_node=request.nproc_per_node,
        matched="meshkit exec",
    )
    node = combine(
        placement,
        None,
        None,
        session=request.session,
        master_port=None,
        nproc_per_node=None,
        gpu_count=gpu_count,
    )
    return with_interface(node, None, os.environ)


def _gather(
    process: subprocess.Popen[bytes],
    streams: dict[int, Kept],
    timeout: float,
    watched: int | None,
) -> str | None:
    """Read both streams (their fds) until they close and the command has exited; or why it
    stopped first: the timeout, or the controller gone."""
    deadline = time.monotonic() + timeout
    poller = select.poll()
    for fd in streams:
        poller.register(fd, select.POLLIN)
    if watched is not None:
        poller.register(watched, select.POLLIN)
    # A command may close its output and go on, or leave a background process holding it:
    # both end with the timeout, as over ssh.
    while streams or process.poll() is None:
        left = deadline - time.monotonic()
        if left <= 0:
            return f"timed out after {timeout:g}s (its process group was killed)"
        slice_s = min(left, POLL_S)
        if not streams:  # its output closed: wait for the exit itself, then look again
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(slice_s)
            slice_s = 0
        for fd, _ in poller.poll(slice_s * 1000):
            if fd == watched:
                return "the controller left (its process group was killed)"
            data = os.read(fd, READ_BYTES)
            if data:
                streams[fd].add(data)
            else:
                poller.unregister(fd)
                del streams[fd]
    return None


def _widen(fd: int) -> None:
    """A larger pipe: a command printing gigabytes then costs a sixteenth of the reads."""
    import fcntl

    with contextlib.suppress(OSError):  # above /proc/sys/fs/pipe-max-size for a user: as it is
        fcntl.fcntl(fd, F_SETPIPE_SZ, READ_BYTES)


def _fd(stream: IO[bytes] | None) -> int:
    if stream is None:  # never: both are pipes
        raise MeshkitError("bash started without its output pipes")
    return stream.fileno()


def _end_group(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the command's process group, then SIGKILL to whatever is left of it."""
    group = process.pid  # start_new_session: its process group id is its pid
    for signal_number in (SIGTERM, SIGKILL):
        try:
            os.killpg(group, signal_number)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + GRACE_S
        while True:
            process.poll()  # reap the leader, or it stays in the group as a zombie
            if not in_group(group) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    if process.poll() is None:
        process.wait()
