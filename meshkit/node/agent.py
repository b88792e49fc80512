"""The node agent: ``python -m meshkit.node serve`` answers one request per line until its stdin
closes, so a whole command (preflight and start, or status, or stop) costs one remote exec per
node. Requests are data (JSON, checked against the protocol's types), never shell.
"""

from __future__ import annotations

import contextlib
import os
import select
import sys
import time
from collections.abc import Callable

from ..protocol import (
    MAX_LINE,
    EnvReply,
    EnvRequest,
    PortsReply,
    PortsRequest,
    PortState,
    ProtocolViolation,
    Reply,
    decode_request,
    encode_reply,
)
from . import jobs
from .inprocess import run_meshkit, this_interpreter
from .signals import SIGKILL

TYPE_CHECKING = False  # no runtime `typing` in the agent (see meshkit/record.py)
if TYPE_CHECKING:
    from typing import IO, Any

ENV_TIMEOUT = 60.0


def env(request: EnvRequest) -> EnvReply:
    """``meshkit env --json ...`` in the job's workdir, as a login there would run it."""
    if not os.path.isdir(request.cwd):
        return EnvReply(1, "", f"cd: {request.cwd}: No such file or directory")
    if this_interpreter(request.argv):
        return _env_forked(request)
    import subprocess  # another interpreter's meshkit only (the fork above is the usual path)

    try:
        done = subprocess.run(
            request.argv,
            cwd=request.cwd,
            capture_output=True,
            text=True,
            timeout=ENV_TIMEOUT,
            check=False,
        )
    except FileNotFoundError:
        return EnvReply(127, "", f"{request.argv[0]}: No such file or directory")
    except subprocess.TimeoutExpired:
        return EnvReply(124, "", f"meshkit env took longer than {ENV_TIMEOUT:.0f}s")
    return EnvReply(done.returncode, done.stdout[-65536:], done.stderr[-65536:])


def _env_forked(request: EnvRequest) -> EnvReply:
    """The same ``meshkit env`` run, in a fork of this agent rather than a new interpreter: the
    child starts with the standard library already imported, which spares every node about
    0.1 s of CPU at every launch. It changes to the workdir, gets its own stdio and runs meshkit's
    own entry point with the same arguments; this process only reads what it printed."""
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        try:
            os.close(out_r)
            os.close(err_r)
            os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
            os.dup2(out_w, 1)
            os.dup2(err_w, 2)
            sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the child exits in run_meshkit
            sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
            sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
        except BaseException:
            os._exit(1)
        run_meshkit(request.cwd, request.argv[3:])
    os.close(out_w)
    os.close(err_w)
    out, err, timed_out = _read_both(out_r, err_r, time.monotonic() + ENV_TIMEOUT)
    if timed_out:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, SIGKILL)
    _, status = os.waitpid(pid, 0)
    if timed_out:
        return EnvReply(124, "", f"meshkit env took longer than {ENV_TIMEOUT:.0f}s")
    text = [b.decode(errors="replace")[-65536:] for b in (out, err)]
    return EnvReply(os.waitstatus_to_exitcode(status), text[0], text[1])


def _read_both(out_fd: int, err_fd: int, deadline: float) -> tuple[bytes, bytes, bool]:
    """Both pipes to their end (each kept to its last 64 KiB), or until ``deadline``."""
    got = {out_fd: b"", err_fd: b""}
    open_fds = [out_fd, err_fd]
    try:
        while open_fds:
            left = deadline - time.monotonic()
            if left <= 0:
                return got[out_fd], got[err_fd], True
            ready, _, _ = select.select(open_fds, [], [], left)
            for fd in ready:
                chunk = os.read(fd, 65536)
                if chunk:
                    got[fd] = (got[fd] + chunk)[-65536:]
                else:
                    open_fds.remove(fd)
    finally:
        os.close(out_fd)
        os.close(err_fd)
    return got[out_fd], got[err_fd], False


def ports(request: PortsRequest) -> PortsReply:
    states = [PortState(p, jobs.port_free(p)) for p in request.ports[:256]]
    return PortsReply(states, jobs.keeper_pid(request.job_id) is not None)


# op -> (module of meshkit.node, function). Modules are imported on first use: every node pays
# the agent's start-up at every command, and a status round needs none of doctor, sync or supervise.
HANDLERS: dict[str, tuple[str, str]] = {
    "env": ("agent", "env"),
    "ports": ("agent", "ports"),
    "start": ("jobs", "start"),
    "jobs": ("jobs", "jobs_request"),
    "status": ("jobs", "status"),
    "stop": ("jobs", "stop"),
    "logs": ("jobs", "logs"),
    "doctor_facts": ("doctor", "facts"),
    "doctor_listen": ("doctor", "listen"),
    "doctor_connect": ("doctor", "connect"),
    "doctor_done": ("doctor", "done"),
    "doctor_probe": ("doctor", "probe"),
    "unsupervise": ("supervise", "unsupervise"),
    "manifest": ("sync", "manifest"),
    "put": ("sync", "put"),
}


def handler(op: str) -> Callable[[Any], Reply]:
    module, name = HANDLERS[op]
    full = f"meshkit.node.{module}"
    __import__(full)  # not importlib (and its warnings): one more import at every agent's start
    found: Callable[[Any], Reply] = getattr(sys.modules[full], name)
    return found


def serve(requests: IO[str], replies: IO[str]) -> None:
    while True:
        line = requests.readline(MAX_LINE + 2)
        if not line:
            return
        try:
            if not line.endswith("\n"):
                raise ProtocolViolation(f"request longer than {MAX_LINE} bytes")
            op, request = decode_request(line)
            out = encode_reply(handler(op)(request))
        except Exception as exc:  # one request failed; say so and keep serving
            out = encode_reply(None, f"{type(exc).__name__}: {exc}")
        replies.write(out)
        replies.flush()
