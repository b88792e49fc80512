"""Warm start, the client side: hand a command to this user's warm server (``warmserver``), which
runs it in a fork of an interpreter that has fabric, paramiko and invoke imported already.

Those imports are about 0.2 s of every host-side command before its first connection (paramiko
alone imports invoke, ``unittest.mock`` and ``importlib.metadata``); through the server the same
command starts connecting after about 0.04 s. Opt-in: config ``warm_start: SECONDS`` (the idle time
after which the server exits) starts one after the first command that runs without it.

The forked child gets this process's stdin, stdout and stderr (the descriptors themselves),
arguments, working directory, environment and umask, so it behaves as this process would have;
this process forwards INT, TERM and HUP to it and exits with its status. A server is only ever
shared by commands that would run the same code the same way: its socket's name is keyed by the
interpreter, its module path, its ``PYTHON*`` variables and this process's namespaces.

Standard library only, and little of it (``socket`` and ``signal`` import ``enum``): this runs
at the start of every eligible command.
"""

from __future__ import annotations

import marshal
import os
import struct
import sys
import zlib
from _socket import AF_UNIX, SCM_RIGHTS, SOCK_STREAM, SOL_SOCKET
from _socket import socket as _sock

from ..node.signals import SIG_DFL, SIGHUP, SIGINT, SIGTERM, signal

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence

# Tasks that only talk to nodes: not env/run (the node side, already lean), not the sandbox
# (namespaces and root set-up), not supervise (a long-lived process of its own), and not
# `mesh --password` (getpass reads the controlling terminal, which the server's child lacks).
TASKS = frozenset({"mesh", "unmesh", "check", "train", "status", "logs", "stop", "doctor"})
MAX_REQUEST = 1 << 20  # bytes: arguments and environment
HEADER = struct.Struct("!I")
PID = struct.Struct("!i")
STALE = b"S"  # the server's code changed since it started: run inline
STARTED = b"P"  # followed by the child's pid, later by its exit status
ANSWER_TIMEOUT = 10.0  # seconds for the server to fork the child and name it
FORWARDED = (SIGINT, SIGTERM, SIGHUP)


# Set in the server's child: the command it runs is already warm (and must not ask the server).
in_server = False


class WarmError(Exception):
    """The server took the command and then failed it (it was not run inline: it may have run)."""


def eligible(argv: Sequence[str]) -> bool:
    """A command the server may run: a node-facing task, not already in the server, and not
    turned off for this command (``MESHKIT_WARM_START=off``, read here: config files are read
    only after the server is asked, since reading them is part of what it saves)."""
    off = os.environ.get("MESHKIT_WARM_START", "").strip().lower() in ("0", "off", "false", "no")
    return not in_server and not off and eligible_task(argv)


def eligible_task(argv: Sequence[str]) -> bool:
    return bool(argv) and argv[0] in TASKS and not (argv[0] == "mesh" and "--password" in argv)


def runtime_dir() -> str:
    """``/tmp/meshkit-UID/warm``, beside the node side's jobs directory."""
    return f"/tmp/meshkit-{os.getuid()}/warm"


def private_dir(path: str) -> bool:
    """``path`` is a real directory of this user's that nobody else can enter, in one of this
    user's that nobody else can write to (as tmux checks its socket directory): only then is a
    socket found there trusted to be this user's own server."""
    return _owned(path, 0o077) and _owned(os.path.dirname(path), 0o022)


def _owned(path: str, forbidden: int) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    is_dir = (st.st_mode & 0o170000) == 0o040000
    return is_dir and st.st_uid == os.getuid() and not st.st_mode & forbidden


def _namespaces() -> str:
    """A server runs the command in its own namespaces: only share one within the same ones."""
    ids = []
    for name in ("net", "mnt", "pid", "user"):
        try:
            ids.append(str(os.stat(f"/proc/self/ns/{name}").st_ino))
        except OSError:
            ids.append("-")
        # (no /proc: no namespaces to tell apart)
    return ".".join(ids)


def key() -> str:
    """What must be equal for a server to run a command as this process would: the interpreter,
    its flags, meshkit's own directory, the module path (without ``sys.path[0]``, the script's
    or working directory), the variables read as the interpreter starts (``PYTHON*``, the
    locale), the namespaces. The server computes it too, and serves only when its own equals
    the one it was started for."""
    fixed = [
        f"{k}={v}"
        for k, v in sorted(os.environ.items())
        if k.startswith("PYTHON") or k in ("LANG", "LC_ALL", "LC_CTYPE")
    ]
    package = os.path.dirname(sys.modules["meshkit"].__file__ or "")
    text = "\0".join(
        [sys.executable, str(sys.flags), package, *sys.path[1:], *fixed, _namespaces()]
    )
    return f"{zlib.crc32(text.encode(errors='surrogateescape')):08x}"


def socket_path() -> str:
    return f"{runtime_dir()}/warm-{key()}.sock"


def run_via_server(argv: Sequence[str]) -> int | None:
    """Run ``meshkit ARGV`` through the warm server and return its exit status, or None when
    there is no usable server (no socket, nobody listening, a stale server): run it inline."""
    directory = runtime_dir()
    if not private_dir(directory):
        return None
    conn = _sock(AF_UNIX, SOCK_STREAM)
    forward = _Forwarder()
    try:
        conn.settimeout(ANSWER_TIMEOUT)
        try:
            conn.connect(socket_path())
        except OSError:
            return None  # no server, or a socket left by one that is gone
        forward.install()  # a Ctrl-C from here on is the command's
        _send(conn, argv)
        answer = _recv_exact(conn, 1)
        if answer == STALE:
            forward.restore()
            return None  # the server took nothing: it ran nothing
        if answer != STARTED:  # (a server that fails here may have forked: never run twice)
            raise WarmError(f"the warm server answered {answer!r}")
        forward.started(PID.unpack(_recv_exact(conn, PID.size))[0])
        conn.settimeout(None)  # the command takes as long as it takes (logs --follow: forever)
        raw = _recv_exact(conn, PID.size)
        if len(raw) < PID.size:
            raise WarmError("the warm server ended before the command did")
        status: int = PID.unpack(raw)[0]
        if status < 0:  # killed by a signal: end the same way, as the shell would see inline
            signal(-status, SIG_DFL)
            os.kill(os.getpid(), -status)
            return 128 - status
        return status
    except TimeoutError:
        raise WarmError(
            f"the warm server at {socket_path()} did not answer in {ANSWER_TIMEOUT:.0f}s; "
            "end it (its pid is in the .pid file beside the socket) or unset warm_start"
        ) from None
    finally:
        conn.close()


def _send(conn: _sock, argv: Sequence[str]) -> None:
    request = marshal.dumps(
        {
            "argv": list(argv),
            "cwd": os.getcwd(),
            "env": dict(os.environ),
            "umask": _umask(),
            "path0": sys.path[0],
            "streams": [
                (s.encoding, s.errors, s.isatty()) for s in (sys.stdin, sys.stdout, sys.stderr)
            ],
        }
    )
    if len(request) > MAX_REQUEST:
        raise WarmError(f"the command and its environment exceed {MAX_REQUEST} bytes")
    data = HEADER.pack(len(request)) + request
    fds = struct.pack("3i", 0, 1, 2)
    sent = conn.sendmsg([data], [(SOL_SOCKET, SCM_RIGHTS, fds)])
    if sent < len(data):
        conn.sendall(data[sent:])


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _recv_exact(conn: _sock, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            return data
        data += chunk
    return data


class _Forwarder:
    """INT, TERM and HUP for the command, from the moment it is asked for: held until the child
    has a pid, then sent to it (a Ctrl-C while the server forks is not lost, nor taken by this
    process alone while the command runs on)."""

    def __init__(self) -> None:
        self.pid: int | None = None
        self.held: list[int] = []
        self.before: dict[int, object] = {}

    def install(self) -> None:
        for number in FORWARDED:
            self.before[number] = signal(number, self.handle)

    def handle(self, signum: int, frame: object) -> None:
        if self.pid is None:
            self.held.append(signum)
            return
        try:  # noqa: SIM105 - contextlib is one more import at every command's start
            os.kill(self.pid, signum)
        except OSError:
            pass  # already gone: its status is on the way

    def started(self, pid: int) -> None:
        self.pid = pid
        for signum in self.held:
            self.handle(signum, None)
        self.held.clear()

    def restore(self) -> None:
        """Declined: the handlers as they were, and what came meanwhile is this process's."""
        for number, handler in self.before.items():
            signal(number, handler)  # type: ignore[arg-type]
        for signum in self.held:
            os.kill(os.getpid(), signum)


def stop_serving() -> None:
    """From the server's child: ask the server (this process's parent) to take no more
    commands (it ends once the running ones are done)."""
    import contextlib
    import signal

    with contextlib.suppress(OSError):  # the server is gone already
        os.kill(os.getppid(), signal.SIGUSR1)


def start_server(idle: float) -> None:
    """Start this user's warm server for the next commands (it detaches at once and exits by
    itself after ``idle`` seconds without one). Not from inside a meshkit job: the job's keeper
    would wait for it, as for any process the job leaves."""
    if "MESHKIT_JOB" in os.environ:
        return
    directory = runtime_dir()
    try:
        os.makedirs(os.path.dirname(directory), mode=0o700, exist_ok=True)
        os.makedirs(directory, mode=0o700, exist_ok=True)
    except OSError:
        return
    if not private_dir(directory):
        return
    import contextlib
    import subprocess

    # Warm start is an optimisation: the command itself already ran, whatever happens here.
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        subprocess.run(
            [sys.executable, "-m", "meshkit.cli.warmserver", socket_path(), f"{idle:g}"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd="/",
            timeout=10,
            check=False,
        )
