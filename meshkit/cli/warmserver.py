"""Warm start, the server: ``python -m meshkit.cli.warmserver SOCKET IDLE``, started by a command
that ran without one (see ``warm``). It imports what the host-side tasks import, then for each
client forks a child that takes the client's descriptors, arguments, directory, environment and
umask and runs meshkit's entry point, and sends the client the child's pid and later its status.

It serves only this user (the socket's directory is private, and the peer's uid is checked),
only while its code is the code on disk (a changed file of meshkit or of anything on its module
path declines every later command, which the client then runs inline, and ends the server), and
ends by itself after IDLE seconds without a command. Single-threaded: it forks.
"""

from __future__ import annotations

import contextlib
import fcntl
import marshal
import os
import select
import signal
import socket
import struct
import sys
import time
from dataclasses import dataclass

from . import warm

MAX_CHILDREN = 64  # commands at once; beyond that a command is declined (and runs inline)
RECV_TIMEOUT = 2.0  # seconds for a client to send its request once connected
FDS = struct.Struct("3i")
CHILD_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}


@dataclass(frozen=True)
class Request:
    argv: list[str]
    cwd: str
    env: dict[str, str]
    umask: int
    path0: str
    streams: list[tuple[str, str, bool]]


class BadRequest(Exception):
    pass


def parse(data: bytes) -> Request:
    """The client's request, every field checked (the peer is this user, but a byte read is a
    byte to check)."""
    try:
        raw = marshal.loads(data)
    except (EOFError, ValueError, TypeError) as exc:
        raise BadRequest(f"unreadable request: {exc}") from None
    if not isinstance(raw, dict):
        raise BadRequest("not a mapping")

    def strings(value: object) -> bool:
        return isinstance(value, list) and all(isinstance(v, str) for v in value)

    argv, cwd, env = raw.get("argv"), raw.get("cwd"), raw.get("env")
    umask, path0, streams = raw.get("umask"), raw.get("path0"), raw.get("streams")
    if not strings(argv) or not argv or not warm.eligible_task(argv):
        raise BadRequest("argv: expected an eligible meshkit command")
    if not isinstance(cwd, str) or not isinstance(path0, str):
        raise BadRequest("cwd, path0: expected strings")
    if not isinstance(env, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in env.items()
    ):
        raise BadRequest("env: expected a mapping of strings")
    if not isinstance(umask, int) or not 0 <= umask <= 0o777:
        raise BadRequest("umask: expected 0..0o777")
    if not (
        isinstance(streams, list)
        and len(streams) == 3
        and all(
            isinstance(s, tuple)
            and len(s) == 3
            and isinstance(s[0], str)
            and isinstance(s[1], str)
            and isinstance(s[2], bool)
            for s in streams
        )
    ):
        raise BadRequest("streams: expected three (encoding, errors, tty)")
    return Request(argv, cwd, env, umask, path0, streams)


def code_state() -> tuple[tuple[str, int, int], ...]:
    """What a changed install changes: every file of the meshkit package (size and mtime) and
    every directory on the module path (an install or removal there changes its mtime)."""
    import meshkit

    found: list[tuple[str, int, int]] = []
    roots = [os.path.dirname(meshkit.__file__ or "")]
    for top in roots:
        for here, dirs, files in os.walk(top):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(here, name)
                    with contextlib.suppress(OSError):
                        st = os.stat(path)
                        found.append((path, st.st_size, st.st_mtime_ns))
    for entry in sys.path[1:]:
        with contextlib.suppress(OSError):
            found.append((entry, 0, os.stat(entry).st_mtime_ns))
    return tuple(sorted(found))


def preload() -> None:
    """What the eligible tasks import (inside their bodies too), so that no child imports it."""
    import fabric  # noqa: F401
    import paramiko  # noqa: F401
    import yaml  # noqa: F401

    from .. import keys, meshplan  # noqa: F401
    from ..ops import doctor, jobs, mesh, supervise, sync  # noqa: F401
    from ..remote import agent, connection, group, hostkeys  # noqa: F401
    from . import main as cli_main
    from .tasks import doctor as tasks_doctor  # noqa: F401

    cli_main.program()


class Server:
    def __init__(self, path: str, idle: float) -> None:
        self.path, self.idle = path, idle
        self.children: dict[int, socket.socket] = {}
        self.hung_up: set[int] = set()
        self.last = time.monotonic()
        self.declining = False
        self.asked_to_decline = False  # SIGUSR1: a command's configuration turned warm start off
        self.state = code_state()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.wake_r, self.wake_w = os.pipe()
        self.lock_fd = -1

    def start(self) -> bool:
        """Take the lock (one server per socket), bind, listen; False: another server has it."""
        self.lock_fd = os.open(self.path + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self.lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # a socket left by a server that is gone (we hold the lock)
        old = os.umask(0o177)
        try:
            self.listener.bind(self.path)
        finally:
            os.umask(old)
        self.listener.listen(16)
        self.inode = os.stat(self.path).st_ino
        with open(self.path + ".pid", "w") as handle:
            handle.write(f"{os.getpid()}\n")
        os.set_blocking(self.wake_w, False)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wakeup fd is written
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        # Only a flag: the wakeup fd ends the select, and the loop declines (closing the
        # listener inside the handler would pull a descriptor from under a select).
        signal.signal(signal.SIGUSR1, lambda *_: setattr(self, "asked_to_decline", True))
        return True

    def serve(self) -> None:
        try:
            while self.children or not self.declining:
                waiting = {c.fileno(): c for p, c in self.children.items() if p not in self.hung_up}
                listening = [] if self.declining else [self.listener.fileno()]
                ready, _, _ = select.select([*listening, self.wake_r, *waiting], [], [], 1.0)
                for fd in ready:
                    if fd == self.wake_r:
                        with contextlib.suppress(BlockingIOError, InterruptedError):
                            os.read(self.wake_r, 512)
                    elif fd in waiting:
                        self.hang_up(waiting[fd])
                    elif not self.declining:
                        self.accept()
                self.reap()
                if self.asked_to_decline:
                    self.decline()
                if not self.children and time.monotonic() - self.last > self.idle:
                    return
        finally:
            self.close()

    def accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        self.last = time.monotonic()
        fds: list[int] = []
        try:
            conn.settimeout(RECV_TIMEOUT)
            creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            if struct.unpack("3i", creds)[1] != os.getuid():
                conn.close()
                return
            request, fds = self.receive(conn)
            if self.declining or len(self.children) >= MAX_CHILDREN or self.state != code_state():
                self.decline()
                conn.sendall(warm.STALE)
                conn.close()
                return
            # INT/TERM/HUP stay blocked in the child until it is set up (see child()).
            signal.pthread_sigmask(signal.SIG_BLOCK, CHILD_SIGNALS)
            pid = os.fork()
            if pid == 0:
                self.child(conn, fds, request)  # never returns
            signal.pthread_sigmask(signal.SIG_UNBLOCK, CHILD_SIGNALS)
            self.children[pid] = conn
            try:
                conn.sendall(warm.STARTED + warm.PID.pack(pid))
            except OSError:  # the client is gone already: end what it started
                self.hung_up.add(pid)
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGHUP)
        except (OSError, BadRequest):
            conn.close()
        finally:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)

    def receive(self, conn: socket.socket) -> tuple[Request, list[int]]:
        space = socket.CMSG_SPACE(FDS.size)
        data, ancdata, flags, _ = conn.recvmsg(warm.HEADER.size + 65536, space)
        fds: list[int] = []
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                usable = len(payload) - len(payload) % 4
                fds += list(struct.unpack(f"{usable // 4}i", payload[:usable]))
        try:
            if flags & socket.MSG_CTRUNC or len(fds) != 3 or len(data) < warm.HEADER.size:
                raise BadRequest("expected three descriptors and a request")
            size = warm.HEADER.unpack(data[: warm.HEADER.size])[0]
            if size > warm.MAX_REQUEST:
                raise BadRequest("request too large")
            body = data[warm.HEADER.size :]
            while len(body) < size:
                chunk = conn.recv(size - len(body))
                if not chunk:
                    raise BadRequest("request cut short")
                body += chunk
            return parse(body[:size]), fds
        except BaseException:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
            raise

    def child(self, conn: socket.socket, fds: list[int], request: Request) -> None:
        """The forked child: become the client's command, as it would have run inline."""
        try:
            signal.set_wakeup_fd(-1)
            for number in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1):
                signal.signal(number, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            for fd in (self.wake_r, self.wake_w, self.lock_fd):
                os.close(fd)
            self.listener.close()
            conn.close()
            for other in self.children.values():
                other.close()
            for target, fd in enumerate(fds):
                os.dup2(fd, target)
                os.close(fd)
            os.umask(request.umask)
            os.environ.clear()
            os.environ.update(request.env)
            import tempfile

            tempfile.tempdir = None  # TMPDIR is the client's now
            modes = ("r", "w", "w")
            streams = [
                open(  # noqa: SIM115 - the child's own stdio, for as long as it runs
                    fd,
                    modes[fd],
                    buffering=1 if tty or fd == 2 else -1,  # as Python sets up its own
                    encoding=enc,
                    errors=err,
                    closefd=False,
                )
                for fd, (enc, err, tty) in enumerate(request.streams)
            ]
            sys.stdin, sys.stdout, sys.stderr = streams
            from .common import conf

            conf.cache_clear()  # the client's configuration, read in its directory
            warm.in_server = True
        except BaseException as exc:
            with contextlib.suppress(OSError):
                os.write(2, f"meshkit: warm start: cannot set the command up: {exc!r}\n".encode())
            os._exit(1)
        try:
            # A Ctrl-C the client forwarded while this child was set up is delivered here.
            signal.pthread_sigmask(signal.SIG_UNBLOCK, CHILD_SIGNALS)
        except KeyboardInterrupt:
            print("meshkit: interrupted", file=sys.stderr, flush=True)
            os._exit(130)
        from ..node.inprocess import run_meshkit

        run_meshkit(request.cwd, request.argv, request.path0)

    def hang_up(self, conn: socket.socket) -> None:
        """A client's connection became readable: it is gone (it sends nothing more). End its
        command as a closed terminal would have."""
        for pid, c in self.children.items():
            if c is conn:
                with contextlib.suppress(OSError):
                    if conn.recv(1):
                        return  # not an end of file: ignore what it sent
                self.hung_up.add(pid)
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGHUP)
                return

    def reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.children.pop(pid, None)
            self.hung_up.discard(pid)
            self.last = time.monotonic()
            if conn is not None:
                with contextlib.suppress(OSError):
                    conn.sendall(warm.PID.pack(os.waitstatus_to_exitcode(status)))
                conn.close()

    def decline(self) -> None:
        """Take no more commands: stop listening (the next command runs inline and starts a
        fresh server); end once the commands running now are done."""
        if not self.declining:
            self.declining = True
            self.unlink()
            self.listener.close()

    def unlink(self) -> None:
        with contextlib.suppress(OSError):
            if os.stat(self.path).st_ino == self.inode:
                os.unlink(self.path)
                os.unlink(self.path + ".pid")

    def close(self) -> None:
        if not self.declining:
            self.unlink()
        self.listener.close()


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m meshkit.cli.warmserver SOCKET IDLE_SECONDS", file=sys.stderr)
        return 2
    path, idle = argv[0], float(argv[1])
    if os.fork() > 0:
        return 0  # the starter waits only for this: the server itself detaches
    os.setsid()
    preload()
    if warm.socket_path() != path or not warm.private_dir(os.path.dirname(path)):
        return 0  # started for another environment than this one: it would serve it wrongly
    server = Server(path, idle)
    if not server.start():
        return 0
    server.serve()
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    os._exit(code)
